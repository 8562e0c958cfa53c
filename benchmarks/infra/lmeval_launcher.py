"""lm-eval 0.4.13's command line, with its RULER tasks generating only the prompts a run scores.

lm-eval's RULER dataset functions ask their sample generators for 500 prompts per length whatever
``--limit`` says (a literal ``num_samples=500``, or the generator's default of 500), and each
prompt's haystack is tokenized to size it: at 128K that is minutes of one core per task, for
prompts that are never sent. This launcher caps that number at ``--samples N`` and then hands the
rest of its arguments, unchanged, to lm-eval's own entry point::

    LMEVAL_PYTHON benchmarks/infra/lmeval_launcher.py --samples 10 run --tasks ruler_vt --limit 10 ...

Run it by path with the interpreter that has lm-eval (``benchmarks/ruler.py`` does): it imports
nothing from this repository. It wraps, in the very module objects lm-eval's YAML loader hands
the tasks, the generator each dataset function calls by its global name, so whatever count a
call passes becomes ``min(count, N)``; lm-eval's sources, scoring and everything else stay as
they are. The generators build their prompts one after another from one random state, so the N
prompts are the first N of the 500 (``docs/benchmarks.md``). Any other lm-eval version, or a
RULER task whose dataset function is not one of those wrapped, stops it with a message instead
of a silent run over all 500.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import inspect
import pathlib
import sys
from typing import Any, Callable

LMEVAL_VERSION = "0.4.13"
# Per utils module of lm_eval/tasks/ruler: the sample generator its dataset functions call by
# global name (read from lm-eval 0.4.13): niah_* -> generate_samples (imported from
# prepare_niah), get_vt_dataset -> get_dataset -> sys_vartrack_w_noise_random, get_cw_dataset ->
# get_dataset -> sys_word_pair_random, fwe_download -> get_dataset -> sys_kwext (count left at
# its default), get_squad / get_hotpotqa -> get_qa_dataset -> get_dataset -> generate_samples.
GENERATORS = {
    "niah_utils": "generate_samples",
    "vt_utils": "sys_vartrack_w_noise_random",
    "cwe_utils": "sys_word_pair_random",
    "fwe_utils": "sys_kwext",
    "qa_utils": "generate_samples",
}
COUNT_PARAMETER = "num_samples"


class LauncherError(SystemExit):
    """What stops the launcher before lm-eval starts (exit status 2, the message on stderr)."""

    def __init__(self, message: str):
        super().__init__(f"lmeval_launcher: {message}")


def check_version(found: str) -> None:
    if found != LMEVAL_VERSION:
        raise LauncherError(f"lm-eval {found} found, the launcher knows {LMEVAL_VERSION}'s RULER generators only; "
                            "read that version's lm_eval/tasks/ruler/*_utils.py and update GENERATORS, or run "
                            "benchmarks/ruler.py with --all-samples")


def capped(generator: Callable[..., list], samples: int) -> Callable[..., list]:
    """``generator`` asked for at most ``samples`` samples: its count argument, passed or
    defaulted, becomes the smaller of the two."""
    signature = inspect.signature(generator)
    if COUNT_PARAMETER not in signature.parameters:
        raise LauncherError(f"{generator.__module__}.{generator.__name__} takes no {COUNT_PARAMETER}")

    @functools.wraps(generator)
    def generate(*args: Any, **kwargs: Any) -> list:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bound.arguments[COUNT_PARAMETER] = min(bound.arguments[COUNT_PARAMETER], samples)
        return generator(*bound.args, **bound.kwargs)

    generate.samples_cap = samples  # type: ignore[attr-defined]  (what verify looks for)
    return generate


def ruler_dir() -> pathlib.Path:
    import lm_eval.tasks  # noqa: PLC0415  (the lm-eval interpreter's, not this repository's)

    return pathlib.Path(lm_eval.tasks.__file__).resolve().parent / "ruler"


def cap_generators(samples: int) -> dict[str, Any]:
    """Load each RULER utils module as lm-eval's YAML loader does (it keeps and reuses the module
    object, see ``lm_eval.tasks._yaml_loader``) and wrap its generator there; returns the modules
    by name."""
    from lm_eval.tasks import _yaml_loader  # noqa: PLC0415

    modules = {}
    for module_name, function_name in GENERATORS.items():
        path = ruler_dir() / f"{module_name}.py"
        if not path.exists():
            raise LauncherError(f"no {path}")
        module = _yaml_loader._load_module_with_cache(path)
        generator = getattr(module, function_name, None)
        if not callable(generator):
            raise LauncherError(f"{path} has no function {function_name}")
        if getattr(generator, "samples_cap", None) is None:
            setattr(module, function_name, capped(generator, samples))
        modules[module_name] = module
    return modules


def verify(samples: int) -> list[str]:
    """Every RULER task YAML, loaded by lm-eval's own loader: its dataset function must call a
    generator capped at ``samples``. Returns the task names checked."""
    from lm_eval.tasks._yaml_loader import load_yaml  # noqa: PLC0415

    checked = []
    for path in sorted(ruler_dir().glob("*.yaml")):
        config = load_yaml(path, resolve_func=True)
        dataset_function = config.get("custom_dataset")
        if dataset_function is None:
            continue  # the group file
        module_name = dataset_function.__module__.rpartition(".")[2]
        function_name = GENERATORS.get(module_name)
        called = dataset_function.__globals__.get(function_name) if function_name else None
        if getattr(called, "samples_cap", None) != samples:
            raise LauncherError(f"{path.name}: its dataset function {dataset_function.__module__}."
                                f"{dataset_function.__name__} does not call a generator capped at {samples} "
                                f"({function_name or 'its module is not in GENERATORS'})")
        checked.append(str(config.get("task", path.stem)))
    return checked


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lmeval_launcher.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--samples", type=int, required=True,
                   help="at most this many RULER samples generated per task and length (the run's --limit)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's command line, e.g. run --tasks ...")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be at least 1")
    check_version(importlib.metadata.version("lm_eval"))
    cap_generators(args.samples)
    verify(args.samples)
    print(f"lmeval_launcher: RULER generators capped at {args.samples} samples per task and length", flush=True)

    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    sys.argv = ["lm-eval", *args.lm_eval_args]  # lm-eval's entry point parses sys.argv
    cli_evaluate()


if __name__ == "__main__":
    main()
