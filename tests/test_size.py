"""Keep modules short (tinygrad's sz.py habit): every module of lrdsl/ and codegen/ and every
template stays under a ceiling; the totals are printed with -s so a change's growth is visible."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CEILING = {".py": 600, ".jinja": 450}


def test_modules_stay_short(capsys):
    files = sorted([*ROOT.glob("lrdsl/*.py"), *ROOT.glob("codegen/*.py"), *ROOT.glob("templates/*.jinja")])
    sizes = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    with capsys.disabled():
        print(f"\nlines: lrdsl {sum(n for f, n in sizes.items() if f.startswith('lrdsl/'))}, "
              f"codegen {sum(n for f, n in sizes.items() if f.startswith('codegen/'))}, "
              f"templates {sum(n for f, n in sizes.items() if f.startswith('templates/'))}")
    too_long = {f: n for f, n in sizes.items() if n > CEILING[Path(f).suffix]}
    assert not too_long, f"split these modules: {too_long}"
