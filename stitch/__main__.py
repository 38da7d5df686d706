"""``python -m stitch`` runs the CLI."""

from stitch.cli import main

main()
