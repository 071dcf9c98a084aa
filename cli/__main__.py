from .main import cli

cli(prog_name="batchinfer")
