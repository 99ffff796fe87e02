import click
@click.group()
def main():
    """moe"""
