"""The argument helpers of the benchmark scripts that take a few `--name value` options before
their specs (decode_sweep.py, pair_sweep.py, finite_loads_cost.py)."""


def option(args: list, name: str, default: str) -> str:
    """The value after `name` in args (both taken out of args), else default."""
    if name in args:
        i = args.index(name)
        value = args[i + 1]
        del args[i:i + 2]
        return value
    return default


def ints(text: str) -> list:
    return [int(x) for x in text.split(",")]
