"""`moed serve`: placeholder until the daemon lands."""

import click


@click.command()
def serve() -> None:
    """Run the daemon in the foreground."""
    raise click.ClickException("not yet")
