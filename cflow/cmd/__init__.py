"""One module per `cflow` sub-command (see cflow/commands.py)."""
