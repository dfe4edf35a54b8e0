"""A built wheel carries the shipped demo policies and the demo's training recipes: a wheel install runs
`offline-rec demo` without rebuilding anything; the experiments and benchmarks beside the package stay out of it."""

import subprocess
import sys
import zipfile

from support.paths import REPO

from offline_rec.demo.behavior_policy import SHIPPED_POLICIES

POLICY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def test_the_wheel_ships_the_demo_policy_and_an_install_finds_it(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO),
                    "-w", str(tmp_path / "wheel")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("offline_rec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for policy in SHIPPED_POLICIES.values():
        assert {f"offline_rec/demo/{policy.folder}/{name}" for name in POLICY_FILES} <= names
    recipes = {path.name for path in (REPO / "offline_rec" / "demo" / "recipes").glob("*.yaml")}
    assert recipes >= {"logged.yaml", "own-model.yaml"}  # the default recipe is a preset (loss.presets)
    assert {f"offline_rec/demo/recipes/{name}" for name in recipes} <= names
    # test fixtures, experiments and benchmarks stay out of the package
    assert not any(name.startswith(("tests/", "experiments/", "benchmarks/")) for name in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True)
    found = subprocess.run(
        [sys.executable, "-I", "-c",
         f"import sys; sys.path.insert(0, {str(site)!r}); "
         "from offline_rec.demo.behavior_policy import demo_policy_path; "
         "from offline_rec.demo.config import DemoSettings, training_recipe; "
         "print(demo_policy_path()); print(demo_policy_path('add3')); "
         "print(training_recipe(DemoSettings())['algorithm'])"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    ).stdout.strip().splitlines()
    arith, add3, algorithm = found
    assert arith.startswith(str(site)) and arith.endswith("arith_policy") and add3.endswith("add3_policy")
    assert algorithm == "rec-logged"  # the recipe file read from the installed package
