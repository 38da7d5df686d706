#!/usr/bin/env bash
# On the GPU machine (no pip index there): register the checkout's plugins by writing their dist-info (metadata +
# entry points, generated from plugins/*/pyproject.toml) into a site folder, so `load_plugins()` finds them the way
# an installed wheel is found. Usage: bash benchmarks/device_site.sh /tmp/site && export PYTHONPATH=/tmp/site:.
set -euo pipefail
DEST=${1:-/tmp/site}; mkdir -p "$DEST"
python3 - "$DEST" <<'PY'
import sys, tomllib, pathlib
dest = pathlib.Path(sys.argv[1])
for pyproject in [pathlib.Path("pyproject.toml"), *sorted(pathlib.Path("plugins").glob("*/pyproject.toml"))]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project.get("version", "0.0.0")
    info = dest / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items())
    (info / "entry_points.txt").write_text(text)
    print(name, version, sorted(groups))
PY
