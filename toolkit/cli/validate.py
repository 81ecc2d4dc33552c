"""`dstk validate FILE...`: schema and cross-field rules; every problem with its JSON path. `dstk schema`:
the JSON Schema it validates against (for editors: VS Code "json.schemas").

Exit code: 0 all valid (warnings allowed), 1 some file invalid, 2 some file unusable.
"""

import json

import click

from toolkit.cli import echo_json

from toolkit.config.problems import ERROR, has_errors

VALID, INVALID, UNUSABLE = 0, 1, 2
STATUS = {VALID: "valid", INVALID: "invalid", UNUSABLE: "unusable"}


def check_file(path: str, world_size=None, pp=None, strict=False, arch=None, sp=None) -> dict:
    """One file -> a report dict: status code, problems (schema first, then rules, then the model's:
    `arch`, a toolkit.plan.arch.Arch, against the file's tensor_parallel size)."""
    from toolkit.config.loader import load_config
    from toolkit.errors import ConfigError, UnusableInput

    try:
        cfg, problems = load_config(path, world_size=world_size, pp=pp, strict=strict, sp=sp)
    except UnusableInput as exc:
        return {"path": path, "code": UNUSABLE, "problems": [{"path": "$", "message": str(exc), "severity": ERROR}]}
    if arch is not None:
        from toolkit.config.rules.tensor_parallel import model_problems
        from toolkit.distributed.topology import tp_of

        try:
            problems += model_problems(cfg, arch, tp_of(cfg))
        except ConfigError:
            pass  # a bad autotp_size is already reported by the rules
        problems += _heads_problems(cfg, arch, sp)
        problems += _experts_problems(cfg, arch)
    problems += _train_problems(cfg, pp)
    code = INVALID if has_errors(problems) else VALID
    return {"path": path, "code": code, "problems": [p.to_dict() for p in problems]}


def _heads_problems(cfg: dict, arch, sp) -> list:
    """Whether Ulysses can split `arch`'s heads sp ways (--sp, else the file's sequence_parallel_size)."""
    from toolkit.config.problems import Problem
    from toolkit.config.rules.sequence_parallel import SP, ulysses_problems
    from toolkit.distributed.topology import sp_of
    from toolkit.errors import ConfigError

    try:
        sp = sp or sp_of(cfg)
    except ConfigError:
        return []  # reported by the rules
    return [Problem(SP, message) for message in ulysses_problems(arch.heads, arch.kv_heads, sp)]


def _experts_problems(cfg: dict, arch) -> list:
    """Whether AutoEP fits `arch`: its preset and the file's autoep_size against the experts."""
    from toolkit.config.rules.expert_parallel import model_problems
    from toolkit.errors import ConfigError

    try:
        return model_problems(cfg, arch)
    except ConfigError:
        return []  # a bad autoep_size is already reported by the rules


def _train_problems(cfg: dict, pp) -> list:
    """What `dstk train` does not run with "expert_parallel" yet (ep with tp, with sp): warnings, since DeepSpeed
    itself may take the file; `dstk train --check` refuses them."""
    from toolkit.config.problems import WARNING, Problem
    from toolkit.config.rules.expert_parallel import train_refusals
    from toolkit.errors import ConfigError

    try:
        refusals = train_refusals(cfg, pp or 1, "1f1b", False)
    except ConfigError:  # a malformed size: the rules have reported it
        return []
    return [Problem("$.expert_parallel", f"dstk train refuses it: {why}", WARNING) for why in refusals]


def _arch(model: str):
    from toolkit.errors import ConfigError
    from toolkit.plan.arch import load_arch

    try:
        return load_arch(model)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None


def _print_human(report: dict) -> None:
    if report["code"] == UNUSABLE:  # one line: the loader's message names the file and the reason
        click.echo(f"error: {report['problems'][0]['message']}", err=True)
        return
    errors = sum(p["severity"] == ERROR for p in report["problems"])
    others = len(report["problems"]) - errors
    summary = STATUS[report["code"]] + (f": {errors} error(s)" if errors else "") + (f", {others} note(s)/warning(s)" if others else "")
    click.echo(f"{report['path']}: {summary}", err=report["code"] != VALID)
    for p in report["problems"]:
        click.echo(f"  {p['severity']}: {p['path']}: {p['message']}", err=report["code"] != VALID)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option("--world-size", type=click.IntRange(min=1), metavar="N", help="Check batch arithmetic for N processes.")
@click.option("--pp", type=click.IntRange(min=1), metavar="N", help="Pipeline stages (default: pipeline.stages in the file, else 1).")
@click.option("--sp", type=click.IntRange(min=1), metavar="N", help="Ulysses sequence-parallel size (default: sequence_parallel_size in the file, else 1); dp = world / (pp x sp x tp).")
@click.option("--strict", is_flag=True, help='Refuse "auto" values (only the HF Trainer/Accelerate fills them).')
@click.option("--model", metavar="NAME|DIR|ORG/NAME", help="Check the model against the file's "
              "tensor_parallel.autotp_size: an AutoTP plan, and tp dividing its heads, key/value heads and "
              "intermediate size; against sp (Ulysses: heads and key/value heads split sp ways); and against "
              "expert_parallel (a preset for its model_type, autoep_size dividing its experts). A built-in architecture (see `dstk plan --help`), a local HF directory, or a "
              "hub id (ORG/NAME at its main branch) whose config.json is read from the Hugging Face cache.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
def validate(files, world_size, pp, sp, strict, model, as_json):
    """Validate DeepSpeed config FILES: all problems, each with its JSON path.

    Exit 0 if valid (warnings allowed), 1 if invalid, 2 if a file cannot be read as a config.
    """
    arch = _arch(model) if model else None
    reports = [check_file(f, world_size=world_size, pp=pp, strict=strict, arch=arch, sp=sp) for f in files]
    if as_json:
        out = {"valid": all(r["code"] == VALID for r in reports),
               "files": [dict(r, status=STATUS[r["code"]]) for r in reports]}
        echo_json(out)
    else:
        for report in reports:
            _print_human(report)
    click.get_current_context().exit(max(r["code"] for r in reports))

@click.command("schema")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the schema to FILE (atomically) instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
def schema(output, force):
    """Print the JSON Schema (draft 2020-12) that dstk validates DeepSpeed configs against."""
    from toolkit.files import write_text
    from toolkit.config.schema import load_schema

    text = json.dumps(load_schema(), indent=2, ensure_ascii=False) + "\n"
    if output:
        write_text(text, output, force=force)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
