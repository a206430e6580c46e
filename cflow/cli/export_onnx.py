"""cflow export-onnx MODEL -o model.onnx: the full-sequence forward (input_ids [1, T] -> logits [1, T, V]) as ONNX."""

HELP = "export a model (preset:NAME[@SIZE] or checkpoint directory) to ONNX"


def add_args(p):
    p.add_argument("model", help="preset:NAME[@SIZE] | cflow checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="output .onnx file (weights > 1 GiB go to OUTPUT.data)")
    from . import whole

    p.add_argument("--seed", type=whole(0), default=0, help="seed of a preset's random weights (default 0)")
    p.add_argument("--external-data", action="store_true",
                   help="always write the weights to OUTPUT.data (default: only when they exceed 1 GiB)")


def run(args) -> int:
    from ..frontend.export import export_onnx, load_torch_model
    from ..util import check_output_path

    check_output_path(args.output, "-o")  # before any work: the directory is created, the file must be writable
    model = load_torch_model(args.model, seed=args.seed)
    out = export_onnx(model, args.output, external_data=True if args.external_data else None)
    print(f"wrote {out}")
    return 0
