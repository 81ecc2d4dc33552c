"""`dstk schema`: print the JSON Schema of DeepSpeed configs (for editors: VS Code "json.schemas")."""

import json

import click


@click.command("schema")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Write the schema to FILE instead of stdout.")
def schema(output):
    """Print the JSON Schema (draft 2020-12) that dstk validates DeepSpeed configs against."""
    from toolkit.config.schema import load_schema

    text = json.dumps(load_schema(), indent=2, ensure_ascii=False) + "\n"
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
