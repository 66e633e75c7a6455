"""Generate the Python code for protos/speculative/v1 into src/specd/proto.

Run `python scripts/gen_protos.py` after editing a .proto file; `--check` exits
non-zero when the committed code differs from what the protos generate (CI).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "src" / "specd" / "proto"
PACKAGE = "specd.proto"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    grpc_include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # protoc writes absolute imports rooted at the proto path; our generated
    # code lives inside the specd package, so re-root them.
    for path in (p for p in out.rglob("*.py*") if p.suffix in (".py", ".pyi")):  # not __pycache__'s .pyc
        text = path.read_text()
        fixed = re.sub(r"^from speculative\.", f"from {PACKAGE}.speculative.", text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
    for pkg in [out / "speculative", out / "speculative" / "v1"]:
        (pkg / "__init__.py").write_text("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(OUT / "speculative", ignore_errors=True)
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for new in sorted(Path(tmp).rglob("*")):
            if new.is_file():
                rel = new.relative_to(tmp)
                old = OUT / rel
                if not old.exists() or not filecmp.cmp(new, old, shallow=False):
                    stale.append(str(rel))
        for old in sorted((OUT / "speculative").rglob("*")):
            fresh = Path(tmp) / old.relative_to(OUT)
            if old.is_file() and "__pycache__" not in old.parts and not fresh.exists():
                stale.append(str(old.relative_to(OUT)))
        if stale:
            print("generated protocol code is stale; run: python scripts/gen_protos.py", file=sys.stderr)
            for s in stale:
                print(f"  {s}", file=sys.stderr)
            return 1
    print("generated protocol code is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
