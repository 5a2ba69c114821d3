"""Keep modules short (tinygrad's sz.py habit): every module of the lrdsl package and every
template stays under a ceiling; the totals per layer are printed with -s so a change's growth is
visible."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CEILING = {".py": 600, ".jinja": 300}
LAYERS = ("frontend", "checks", "codegen/templates", "codegen", "runtime")


def layer(path: str) -> str:
    """The layer a file of lrdsl/ belongs to (the API and tools stand at the top level)."""
    return next((name for name in LAYERS if path.startswith(f"lrdsl/{name}/")), "api and tools")


def test_modules_stay_short(capsys):
    files = sorted([*ROOT.glob("lrdsl/**/*.py"), *ROOT.glob("lrdsl/codegen/templates/*.jinja")])
    sizes = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    totals = {}
    for f, n in sizes.items():
        totals[layer(f)] = totals.get(layer(f), 0) + n
    with capsys.disabled():
        print("\nlines: " + ", ".join(f"{name} {n}" for name, n in sorted(totals.items())))
    too_long = {f: n for f, n in sizes.items() if n > CEILING[Path(f).suffix]}
    assert not too_long, f"split these modules: {too_long}"
