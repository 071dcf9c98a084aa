"""`python -m batchinfer`: the batchinfer command (as `python -m batchinfer.cli`)."""
from batchinfer.cli.main import cli

cli(prog_name="batchinfer")
