"""MkDocs hooks (`hooks:` in mkdocs.yml).

The figures in the docs are the committed benchmark results themselves, not
copies: every `benchmarks/results/*.png` is served at `results/<name>.png` in the
site, so a page links `../results/sweep-cpu.png` (from `tutorials/`) and shows
whatever `benchmarks/` last wrote."""

from pathlib import Path

from mkdocs.structure.files import File


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"results/{png.name}", abs_src_path=str(png))
        )
    return files
