"""The `lrdsl` command line."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import LrdslError, SpecError

EPILOG = """examples:
  lrdsl show examples/gated_deltanet.lr        desugared explicit form and canonical form
  lrdsl check examples/gdn2.lr                 eigenvalues, spectral norm, stability
  lrdsl check examples/gdn2.lr --json          the same as one JSON object
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lrdsl", description="Compile linear-recurrence token mixers "
                                "from a spec: parse, check the transition, emit kernels.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__
    p.add_argument("--version", action="version", version=f"lrdsl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("show", help="print the explicit form and the canonical form of a spec")
    s.add_argument("spec", help="path to a .lr spec file")
    c = sub.add_parser("check", help="prove or disprove facts about the transition's eigenvalues")
    c.add_argument("spec", help="path to a .lr spec file")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _load(path: str, check_stability: bool):
    from .api import compile
    return compile(path, check_stability=check_stability)


def cmd_show(args) -> int:
    m = _load(args.spec, check_stability=False)
    print("# explicit form")
    print(m.explicit(), end="")
    print("\n# canonical form")
    print(m.canonical(), end="")
    return 0


def cmd_check(args) -> int:
    from .checker import explain, stability_error
    m = _load(args.spec, check_stability=False)
    facts = m.check()
    msg = stability_error(m.ir, facts)
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
    else:
        print(f"mixer {m.name}: M = {m.canonical().splitlines()[1].split('M = ')[-1].split(',')[0]}")
        print(explain(facts), end="")
    if msg:
        raise SpecError(msg, m.ir.update_span, m.source, m.filename)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        return {"show": cmd_show, "check": cmd_check}[args.command](args)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        ctx = e.context()
        if ctx:
            print(ctx, file=sys.stderr)
        return 1
    except LrdslError as e:
        print(f"lrdsl: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
