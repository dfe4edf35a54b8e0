"""A built wheel carries the shipped demo policies: a wheel install runs `offline-rec demo` without rebuilding."""

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
    assert not any(name.startswith("tests/") for name in names)  # test fixtures stay out of the package

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True)
    found = subprocess.run(
        [sys.executable, "-I", "-c",
         f"import sys; sys.path.insert(0, {str(site)!r}); "
         "from offline_rec.demo.behavior_policy import demo_policy_path; "
         "print(demo_policy_path(), demo_policy_path('add3'))"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    ).stdout.strip()
    arith, add3 = found.split()
    assert arith.startswith(str(site)) and arith.endswith("arith_policy") and add3.endswith("add3_policy")
