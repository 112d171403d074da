"""The lab's house: its layers only call downwards, each package opens with a reading map that
names its every module, docs/layout.md lists every module once in layer order, no file grows past
500 lines, and no code outside the zoo asks which model it was given."""
import ast
import re
from pathlib import Path

import lab
from lab import zoo

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab"
UNITS = [unit for layer in lab.LAYERS for unit in layer]
RANK = {unit: rank for rank, layer in enumerate(lab.LAYERS) for unit in layer}


def modules() -> list[Path]:
    return sorted(path for path in LAB.rglob("*.py") if path != LAB / "__init__.py")


def unit_of(path: Path) -> str:
    return path.relative_to(LAB).with_suffix("").parts[0]


def lab_imports(path: Path) -> list[tuple[int, str]]:
    """(line, unit) of every import of the lab in `path`, at any depth (imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lab":
            parts = node.module.split(".")
            found += [(node.lineno, parts[1])] if len(parts) > 1 else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("lab.")]
    return found


def package_map(package: str) -> list[str]:
    """The modules a package's reading map names, in its order: "1. `pool.py` ..."."""
    doc = ast.get_docstring(ast.parse((LAB / package / "__init__.py").read_text())) or ""
    return [name for line in doc.splitlines() for name in re.findall(r"^\s*\d+\.\s+`(\w+\.py)`", line)]


def test_every_module_belongs_to_a_layer_and_imports_only_layers_below():
    wrong = []
    for path in modules():
        me = unit_of(path)
        assert me in RANK, f"{path.relative_to(ROOT)}: lab.LAYERS does not place {me!r}"
        for line, unit in lab_imports(path):
            if unit != me and RANK.get(unit, len(UNITS)) >= RANK[me]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer {RANK[me]}) imports lab.{unit} "
                             f"(layer {RANK.get(unit)})")
    assert not wrong, "\n".join(wrong)


def test_the_top_holds_the_commands_and_config_and_every_package_opens_with_its_map():
    top = sorted(path.name for path in LAB.glob("*.py"))
    packages = sorted(path.parent.name for path in LAB.glob("*/__init__.py"))
    assert top == sorted(["__init__.py", "config.py", "theory.py", *(f"{unit}.py" for unit in lab.LAYERS[-1])]), top
    assert len(packages) >= 4, packages
    for package in packages:
        named = package_map(package)
        files = sorted(path.name for path in (LAB / package).glob("*.py") if path.name != "__init__.py")
        assert "Reading map" in (LAB / package / "__init__.py").read_text(), package
        if package == "zoo":  # its map names the card and the first model to read; the models are alike
            assert set(named) <= set(files), (package, named, files)
        else:
            assert sorted(named) == files and len(set(named)) == len(named), (package, named, files)


def test_no_file_of_the_lab_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): n for path in modules() if (n := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_the_layout_page_lists_every_module_once_in_layer_order():
    page = (ROOT / "docs" / "layout.md").read_text()
    section = page[page.index("## `lab/`"):page.index("## The rest")]
    listed = [name for row in section.splitlines() if row.startswith("|")
              for name in re.findall(r"`(lab/[\w/]+\.py)`", row)]
    expected = []
    for unit in UNITS:
        if (LAB / unit).is_dir():
            names = package_map(unit) if unit != "zoo" else ["cards.py"]  # the page names no model file
            expected += [f"lab/{unit}/{name}" for name in names]
        else:
            expected.append(f"lab/{unit}.py")
    assert listed == expected


def test_no_code_outside_the_zoo_asks_for_a_model_by_name():
    """A comparison with a model's name (`model == "cnn"`, `in ("transformer", "cnn")`) belongs on the
    model's card: the page, the tables and the commands read the card."""
    names = set(zoo.CARDS)
    found = []
    for path in [p for p in modules() if unit_of(p) != "zoo"] + [ROOT / "app.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c.value for side in [node.left, *node.comparators] for c in ast.walk(side)
                             if isinstance(c, ast.Constant)]
                if names & set(constants):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
