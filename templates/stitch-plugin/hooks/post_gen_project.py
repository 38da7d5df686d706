"""Write the bundled demo dataset with the plugin's own generator, so its shipped recipe runs right away."""

import importlib.util
from pathlib import Path

package = Path("src") / "{{ cookiecutter.package_name }}"
spec = importlib.util.spec_from_file_location("_stitch_plugin_demo_data", package / "demo_data.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.write_dataset(package / "recipes" / "data")
