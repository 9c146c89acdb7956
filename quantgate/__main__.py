"""`python -m quantgate` runs the CLI."""
from quantgate.cli import main

main(prog_name="quantgate")
