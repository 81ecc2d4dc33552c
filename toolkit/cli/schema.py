"""`dstk schema`: print the JSON Schema of DeepSpeed configs (for editors: VS Code "json.schemas")."""

import json

import click


@click.command("schema")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the schema to FILE (atomically) instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
def schema(output, force):
    """Print the JSON Schema (draft 2020-12) that dstk validates DeepSpeed configs against."""
    from toolkit.config.generate import write_text
    from toolkit.config.schema import load_schema

    text = json.dumps(load_schema(), indent=2, ensure_ascii=False) + "\n"
    if output:
        write_text(text, output, force=force)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
