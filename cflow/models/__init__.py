"""The reference PyTorch pipeline-native model family, its presets, checkpoints and training.

`ModelConfig` and `PRESETS` import without torch; `PipelineNativeLM` and `from_preset` need torch.
"""

from ..ir.config import ModelConfig
from .bundled import default_model_dir
from .presets import ARCHS, PRESETS, SIZES, get_preset, parse_preset_spec


def from_preset(name: str, size: str = "tiny", seed: int = 0):
    """A PipelineNativeLM with deterministic random weights: what `preset:NAME@SIZE` means everywhere."""
    import torch

    from .reference import PipelineNativeLM

    config = get_preset(name, size)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = PipelineNativeLM(config)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.eval()


def __getattr__(name):
    if name == "PipelineNativeLM":
        from .reference import PipelineNativeLM

        return PipelineNativeLM
    raise AttributeError(name)


__all__ = ["ModelConfig", "PRESETS", "SIZES", "ARCHS", "PipelineNativeLM", "from_preset", "get_preset",
           "parse_preset_spec", "default_model_dir"]
