"""Eject a recipe: write it as one self-contained script, with the core code it uses copied in.

    python scripts/eject.py mnist_onecycle my_train.py
    python scripts/eject.py path/to/recipes/NAME.py OUTPUT.py
    python scripts/eject.py mnist_onecycle my_train.py --overwrite     # replace an earlier copy

Recipes import the shared core by name (``from common.loop import train_step``). To start a project of your
own from a recipe without carrying ``common/`` along, eject writes OUTPUT: the recipe's docstring, one merged
import block (all of the recipe's imports, and the core's that the copied code reads), the recipe's own code
(the lesson comes first), then the core's functions, classes and constants that the recipe needs (directly or
through each other; nothing else), one section per core module, and last the recipe's ``if __name__ ==
"__main__":`` block. Definitions are copied as written, so their comments and docstrings stay. ``from
__future__ import annotations`` lets the recipe's annotations name core types defined below it; anything else
the recipe runs when it is imported (a base class, a decorator, a default value, a function called at the top
level) may not use the core. Eject runs the new script's top level once to make sure, and writes OUTPUT only
if it imports.

What to copy is decided on the syntax tree, never on text: a name counts as used where code reads it as a
module-level name; annotations, decorators and default values count, a function's parameters and local
variables do not. A core import whose name means something else in the merged file (the core's ``from
pathlib import Path`` in a recipe that defines a ``Path`` of its own) is imported under an alias
(``PathlibPath``) and renamed where the core uses it. A core name that the recipe defines too is an error.

Exit status 0 on success, 2 on a usage error (wrong arguments, unknown recipe), 1 on any other problem;
every error is one line ``error: ...`` on stderr.
"""

import argparse
import ast
import builtins
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib.machinery import PathFinder
from pathlib import Path

HERE = Path(__file__).resolve().parent  # scripts/, first on sys.path here but not where the script will run
ROOT = HERE.parent
CORE = "common"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class EjectError(Exception):
    """A recipe that cannot be ejected as it is: reported as one line, exit 1."""


@dataclass(frozen=True)
class Import:
    """One imported name: ``from torch import nn`` is Import("torch", "nn"), ``import torch`` Import("torch")."""

    module: str
    name: str | None = None
    alias: str | None = None

    @property
    def key(self) -> str:  # how code refers to it: "nn", "dist", or "urllib.error" for `import urllib.error`
        return self.alias or self.name or self.module

    @property
    def binding(self) -> str:  # the module-level name it binds
        return self.key.split(".")[0]

    @property
    def meaning(self) -> tuple:  # imports that bind one name must agree on this to share the name
        return (self.module if self.name or self.alias else self.binding), self.name


@dataclass(eq=False)
class Definition:
    """A top-level statement of a module that binds names: a function, a class, a constant."""

    source: "Source"
    node: ast.stmt
    names: set[str]


@dataclass(eq=False)
class Source:
    """A parsed file and what each of its module-level names refers to."""

    label: str  # "common/cli.py"
    lines: list[str]
    tree: ast.Module
    imports: dict[str, Import]  # by Import.key
    core_imports: dict[str, tuple[str, str]]  # name -> (core module, name there)
    core_modules: dict[str, str]  # `from common import cli`: "cli" -> "cli"
    definitions: dict[str, Definition]


def dotted(node: ast.AST) -> tuple[ast.Name, str] | None:
    """``torch.cuda.is_available`` -> (the Name ``torch``, "torch.cuda.is_available"); None if not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node, ".".join([node.id, *reversed(parts)])) if isinstance(node, ast.Name) else None


def bound_names(statements: list[ast.AST]) -> set[str]:
    """Names that statements bind in their own scope (not in the functions and classes they define)."""
    names, declared_global, todo = set(), set(), list(statements)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, *COMPREHENSIONS)):  # their variables are their own
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            declared_global.update(node.names)
        todo.extend(ast.iter_child_nodes(node))
    return names - declared_global


def function_parts(fn: ast.AST) -> tuple[frozenset[str], list[ast.AST], list[ast.AST]]:
    """(parameter names, what is evaluated where ``fn`` is defined, its body)."""
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
    outer = [*getattr(fn, "decorator_list", []), *args.defaults, *filter(None, args.kw_defaults),
             *filter(None, [p.annotation for p in params] + [getattr(fn, "returns", None)])]
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    return frozenset(p.arg for p in params), outer, body


def global_refs(node: ast.AST, local: frozenset[str] = frozenset()
                ) -> Iterator[tuple[ast.Name, str, frozenset[str]]]:
    """Every read of a module-level name in ``node``, as (Name node, dotted path, the local names where it is read);
    reads of parameters and local variables (``local``, and those of the functions inside ``node``) are left out."""
    if found := dotted(node):
        if isinstance(found[0].ctx, ast.Load) and found[0].id not in local:
            yield *found, local
    elif isinstance(node, FUNCTIONS):
        params, outer, body = function_parts(node)
        for child in outer:
            yield from global_refs(child, local)
        inner = local | params | bound_names(body)
        for child in body:
            yield from global_refs(child, inner)
    else:
        if isinstance(node, COMPREHENSIONS):
            local = local | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        for child in ast.iter_child_nodes(node):
            yield from global_refs(child, local)


BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"  # the recipes' own, as ast.unparse writes it


def is_bootstrap(node: ast.stmt) -> bool:
    """``sys.path.insert(0, ...)``: how a recipe finds common/ in a clone. An ejected file needs none."""
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and (dotted(call.func) or (None, ""))[1] in ("sys.path.insert", "sys.path.append")


def parse(path: Path, label: str, core: bool = False) -> Source:
    """``core``: a module of the core, whose top level eject copies one definition per name, so each name is bound
    by one statement, and a statement that binds none (``TABLE["x"] = 1``) would be lost."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EjectError(f"{label} is not a Python file in UTF-8") from None
    try:
        tree = ast.parse(text, filename=label)
    except SyntaxError as err:
        raise EjectError(f"{label}{f':{err.lineno}' if err.lineno else ''}: {err.msg}") from None  # (a NUL byte: none)
    source = Source(label, text.splitlines(), tree, {}, {}, {}, {})
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or node.names[0].name == "*"):
            raise EjectError(f"{label}:{node.lineno}: relative and star imports cannot be merged")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                item = (Import(node.module, alias.name, alias.asname) if isinstance(node, ast.ImportFrom)
                        else Import(alias.name, None, alias.asname))
                if item.module.split(".")[0] != CORE:
                    source.imports[item.key] = item
                elif item.module == CORE and item.name and not item.alias:
                    source.core_modules[item.name] = item.name
                elif item.name is None or item.alias or item.module == CORE:
                    raise EjectError(f"{label}:{node.lineno}: import core names as `from {CORE}.MODULE import NAME` "
                                     f"or `from {CORE} import MODULE`")
                else:
                    source.core_imports[item.name] = (item.module.split(".", 1)[1], item.name)
        elif names := bound_names([node]):
            if core and (again := sorted(names & source.definitions.keys())):
                raise EjectError(f"{label}:{node.lineno}: {again[0]} is bound again at the top level, and eject copies "
                                 "one statement per name; bind it once")
            definition = Definition(source, node, names)
            source.definitions.update(dict.fromkeys(names, definition))
        elif core and not (node is tree.body[0] and ast.get_docstring(tree) is not None):
            raise EjectError(f"{label}:{node.lineno}: a top-level statement that binds no name is not copied; "
                             "do this inside a definition")
    # eject merges the imports at the top of a file; one inside a function would stay, and fail in the copy
    for node in (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in tree.body):
        modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
        if any(module.split(".")[0] == CORE for module in modules):
            raise EjectError(f"{label}:{node.lineno}: import the core at the top of the file, not inside a block")
    return source


def member_key(name: str) -> tuple:
    """isort's order within ``from x import ...``: CONSTANTS, then Classes, then everything else."""
    return (0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2), name.lower(), name


def import_lines(imports: list[Import]) -> list[str]:
    """One section of the import block, sorted and merged as isort (ruff's rule I001) wants it."""
    straight = sorted((i for i in imports if i.name is None), key=lambda i: (i.module.lower(), i.module, i.key))
    lines = [f"import {i.module}" + (f" as {i.alias}" if i.alias else "") for i in straight]
    statements: dict[tuple, list[Import]] = {}  # one per module, plus one per aliased name
    for i in imports:
        if i.name is not None:
            statements.setdefault((i.module, i.alias), []).append(i)
    for names in statements.values():
        names.sort(key=lambda i: member_key(i.name))
    for names in sorted(statements.values(), key=lambda s: (s[0].module.lower(), s[0].module, member_key(s[0].name))):
        shown = [f"{i.name} as {i.alias}" if i.alias else i.name for i in names]
        line = f"from {names[0].module} import {', '.join(shown)}"
        if len(line) > 120:  # isort's wrapping: one name per line
            line = f"from {names[0].module} import (\n" + "".join(f"    {name},\n" for name in shown) + ")"
        lines.append(line)
    return lines


def is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``, which eject moves to the end of the script, below the core."""
    test = node.test if isinstance(node, ast.If) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def is_header(node: ast.stmt) -> bool:
    """The docstring, the imports and the bootstrap at the top of a recipe: eject writes its own."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return isinstance(node.value.value, str)
    return isinstance(node, (ast.Import, ast.ImportFrom)) or is_bootstrap(node)


def first_line(definition: Definition) -> int:
    """Where a definition's text starts: at its decorators, or at comment lines directly above it."""
    node, lines = definition.node, definition.source.lines
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    while first > 1 and lines[first - 2].startswith("#"):
        first -= 1
    return first


def blank_lines(previous: Definition, definition: Definition) -> int:
    """Two around functions and classes (PEP 8); between constants as many as the original had (at most 2)."""
    if any(isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for d in (previous, definition)):
        return 2
    above = definition.source.lines[: first_line(definition) - 1]
    return min(2, len(above) - len("\n".join(above).rstrip().splitlines()))


class Ejection:
    """One recipe and the core definitions it needs; ``text()`` is the self-contained script."""

    def __init__(self, recipe: Path):
        path = recipe.resolve()
        self.label = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        self.recipe = parse(path, self.label)
        self.modules: dict[str, Source] = {}
        header = list(itertools.takewhile(is_header, self.recipe.tree.body))
        self.body = self.recipe.tree.body[len(header) :]
        self.body_start = header[-1].end_lineno if header else 0  # the recipe's own code starts below this line
        for node in (n for n in header if is_bootstrap(n) and ast.unparse(n) != BOOTSTRAP):  # a user's own path
            print(f"warning: {self.label}:{node.lineno}: the copy leaves out {ast.unparse(node)} (eject writes its "
                  "own imports); add it back above them if the copy needs it", file=sys.stderr)
        if late := next((n for n in self.body if isinstance(n, (ast.Import, ast.ImportFrom))), None):
            raise EjectError(f"{self.label}:{late.lineno}: move this import to the top of the recipe")
        guard = next((n for n in self.body if is_main_guard(n)), None)
        if guard is None or guard is not self.body[-1]:
            raise EjectError(f"{self.label}: end the recipe with its `if __name__ == \"__main__\":` block")
        # definition -> its reads of imports, in the order they were reached
        self.taken: dict[Definition, list[tuple[ast.Name, Import]]] = {}
        self.module_reads: dict[Source, list[ast.Name]] = {}  # file -> the `cli` of each `cli.Epochs`, to be cut out
        self.core_builtins: set[str] = set()  # the builtins the core code read: the recipe may not rebind them
        self.recipe_reads = self.take(self.recipe, self.body)
        self.sections = self.order_sections()
        self.renames = self.check_names()

    def module(self, name: str) -> Source:
        if name not in self.modules:
            path = ROOT / CORE / f"{name.replace('.', '/')}.py"
            if not path.is_file():
                raise EjectError(f"{CORE}.{name} is imported, but {path} does not exist")
            self.modules[name] = parse(path, path.relative_to(ROOT).as_posix(), core=True)
        return self.modules[name]

    def resolve(self, source: Source, path: str) -> Definition | Import | None:
        """What a read of ``path`` ("torch.cuda.is_available", "Run") in ``source`` refers to; None: a builtin."""
        parts = path.split(".")
        for n in range(len(parts), 0, -1):  # `import urllib.error` is known by its whole dotted name
            if ".".join(parts[:n]) in source.imports:
                return source.imports[".".join(parts[:n])]
        if parts[0] in source.definitions:
            return source.definitions[parts[0]]
        if parts[0] in source.core_modules and len(parts) > 1:  # cli.Epochs: Epochs in common/cli.py
            module, name = source.core_modules[parts[0]], parts[1]
            if (target := self.resolve(self.module(module), name)) is None:
                raise EjectError(f"{source.label} reads {parts[0]}.{name}, but {CORE}.{module} has no {name}")
            return target
        if parts[0] not in source.core_imports:
            return None
        module, name = source.core_imports[parts[0]]
        if (target := self.resolve(self.module(module), name)) is None:
            raise EjectError(f"{source.label} imports {name} from {CORE}.{module}, which has no {name}")
        return target

    def take(self, source: Source, nodes: list[ast.AST]) -> list[tuple[ast.Name, Import]]:
        """Take the core definitions that ``nodes`` read, and theirs in turn; return the reads of imports."""
        import_reads = []
        for node in nodes:
            for name, path, local in global_refs(node):
                target = self.resolve(source, path)
                if target is None and source is not self.recipe and name.id in dir(builtins):
                    self.core_builtins.add(name.id)
                if name.id in source.core_modules:  # `cli.Epochs` becomes `Epochs` in the merged file
                    if "." not in path:  # `getattr(cli, ...)`: the module itself, which the merged file has not
                        raise EjectError(f"{source.label}:{name.lineno}: {name.id} is read as a module, which a copy "
                                         f"does not have; read its names as {name.id}.NAME")
                    if (bare := path.split(".")[1]) in local:  # `vocab_state = hf_tokens.vocab_state(...)`
                        raise EjectError(f"{source.label}:{name.lineno}: {name.id}.{bare} is {bare} in a copy, where "
                                         f"the local {bare!r} of this function would hide it; rename the local")
                    self.module_reads.setdefault(source, []).append(name)
                if isinstance(target, Import):
                    import_reads.append((name, target))
                elif isinstance(target, Definition) and target.source is not self.recipe and target not in self.taken:
                    self.taken[target] = []  # first: a definition may read itself
                    self.taken[target] = self.take(target.source, [target.node])
        return import_reads

    def order_sections(self) -> list[tuple[Source, list[Definition]]]:
        """Core modules after those they import from, definitions in source order: whatever a definition reads
        when it is defined (base classes, decorators, annotations, defaults) is defined above it."""
        order: list[Source] = []

        def visit(source: Source) -> None:
            if source not in order:
                modules = {module for module, _ in source.core_imports.values()} | set(source.core_modules.values())
                for module in sorted(modules & self.modules.keys()):
                    visit(self.module(module))
                order.append(source)

        for name in sorted(self.modules):
            visit(self.modules[name])
        return [(source, sorted((d for d in self.taken if d.source is source), key=lambda d: d.node.lineno))
                for source in order if any(d.source is source for d in self.taken)]

    def check_names(self) -> dict[Import, Import]:
        """Make every module-level name of the merged file mean one thing: a core definition may not share a name
        with the recipe's code; a core import that would is given an alias. Returns {import: aliased import}."""
        owners = {name: (self.label, self.label) for name in bound_names(self.body)}  # name -> (meaning, where)
        # a recipe's own print() (or rich's), say, which the core's reads of print would mean in the merged file
        if hidden := sorted(bound_names(self.recipe.tree.body) & self.core_builtins):
            raise EjectError(f"{self.label} defines {', '.join(hidden)}, which the core code it uses reads as Python's "
                             "builtin; rename it in the recipe")
        for item in [*(item for _, item in self.recipe_reads), *self.recipe.imports.values()]:  # read or not, all stay
            owners.setdefault(item.binding, (item.meaning, f"an import in {self.label}"))
        for source, definitions in self.sections:
            for definition in definitions:
                for name in sorted(definition.names):
                    if name in owners:
                        raise EjectError(f"the recipe needs {name!r} from {source.label}, but {owners[name][1]} "
                                         f"defines {name!r} too; rename it there")
                    owners[name] = (definition, source.label)
        renames = {}
        core_imports = {item for reads in self.taken.values() for _, item in reads}
        for item in sorted(core_imports, key=lambda i: (i.module, i.name or "", i.alias or "")):
            if owners.setdefault(item.binding, (item.meaning, item.module))[0] != item.meaning:
                package = item.module.split(".")[0]  # rich.progress.Progress -> RichProgress
                alias = f"{package}_{item.binding}" if item.binding.islower() else package.capitalize() + item.binding
                if alias in owners or item.key != item.binding:
                    raise EjectError(f"{item.binding!r} means two things in {self.label} and the core it uses")
                renames[item] = replace(item, alias=alias)
                owners[alias] = (item.meaning, item.module)
        return renames

    def edited(self, source: Source, lines: list[str], first: int, reads: list[tuple[ast.Name, Import]]) -> str:
        """``lines`` (the first is line ``first`` of ``source``) with each read of an aliased import renamed and
        each ``cli.`` of a core module's name cut out."""
        last = first + len(lines) - 1
        edits = [(name, self.renames[item].alias) for name, item in reads if item in self.renames]
        edits += [(name, None) for name in self.module_reads.get(source, []) if first <= name.lineno <= last]
        for name, alias in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
            row = lines[name.lineno - first].encode()  # AST column offsets count UTF-8 bytes
            if alias is None:  # `cli.Epochs` -> `Epochs`
                lines[name.lineno - first] = (row[: name.col_offset] + row[name.end_col_offset + 1 :]).decode()
            else:
                row = row[: name.col_offset] + alias.encode() + row[name.end_col_offset :]
                lines[name.lineno - first] = row.decode()
        return "\n".join(lines)

    def definition_text(self, definition: Definition) -> str:
        first = first_line(definition)
        lines = definition.source.lines[first - 1 : definition.node.end_lineno]
        return self.edited(definition.source, list(lines), first, self.taken[definition]) \
            if definition.source is not self.recipe else ""

    def import_block(self) -> str:
        reads = [*self.recipe_reads, *(read for reads in self.taken.values() for read in reads)]
        # the recipe's own imports all stay, read or not: `import torchvision` may be there to register its ops
        used = {self.renames.get(item, item) for _, item in reads} | set(self.recipe.imports.values())
        stdlib = [item for item in used if item.module.split(".")[0] in sys.stdlib_module_names]
        third_party = [item for item in used if item not in stdlib]
        groups = [["from __future__ import annotations"], *(import_lines(g) for g in (stdlib, third_party) if g)]
        return "\n\n".join("\n".join(group) for group in groups)

    def text(self, script: str) -> str:
        """The merged file, whose docstring calls it ``script`` where it named the recipe's file."""
        lines, tree = self.recipe.lines, self.recipe.tree
        named = rf"(?<![\w.-]){re.escape(self.label)}(?!\w)"  # the recipe's own name, not a longer one ending so
        in_docstring = script.replace("\\", "\\\\")  # a backslash in the name is no escape in the docstring
        docstring = [re.sub(named, lambda _: in_docstring, "\n".join(lines[: tree.body[0].end_lineno]))] \
            if ast.get_docstring(tree) else []
        generated = (f"# Generated by scripts/eject.py from {self.label} and the torch-recipes core ({CORE}/): the\n"
                     "# recipe comes first, then the core code it uses, so this file runs on its own. Edit it freely.\n"
                     "# The docs/, scripts/, benchmarks/ and README it names are the torch-recipes repository's.")
        head = "\n\n".join([*docstring, generated, self.import_block()]).rstrip("\n")
        guard_start = self.body[-1].lineno
        own = lines[self.body_start : guard_start - 1]
        recipe = self.edited(self.recipe, list(own), self.body_start + 1, []).strip("\n")
        # where the recipe's block starts, in the recipe (1-based, after the blank lines strip() took) and below
        self.recipe_start = self.body_start + 1 + next((i for i, line in enumerate(own) if line), len(own))
        self.recipe_length = len(recipe.splitlines())
        blocks = [f"# ---- from {self.label} ----\n\n\n{recipe}"]
        for source, definitions in self.sections:
            text = self.definition_text(definitions[0])
            for previous, definition in zip(definitions, definitions[1:], strict=False):
                text += "\n" * (blank_lines(previous, definition) + 1) + self.definition_text(definition)
            blocks.append(f"# ---- from {source.label} ----\n\n\n{text}")
        blocks.append(self.edited(self.recipe, list(lines[guard_start - 1 :]), guard_start, []).strip("\n"))
        self.script_start = len(head.splitlines()) + 5  # a blank line, the block's heading, two blank lines
        return head + "\n\n" + "\n\n\n".join(blocks) + "\n"  # isort wants one blank line after the imports

    def import_failure(self, line: int, error: str) -> str:
        """What ``check_imports`` found, said of the recipe's own line where the script's line is the recipe's."""
        offset = line - self.script_start
        at = f"{self.label}:{self.recipe_start + offset}" if 0 <= offset < self.recipe_length else \
            f"line {line} of the script"
        missing = re.fullmatch(r"NameError: name '(\w+)' is not defined", error)
        why = ("; the recipe comes first in the script, so what runs when it is imported (its top level, and the "
               "functions that calls) cannot use the core: use it inside a function that runs later") \
            if missing and any(missing[1] in d.names for d in self.taken) else ""
        return f"the ejected script fails when it is imported, at {at} ({error}){why}"


# Runs a script's top level as the module "ejected", named as OUTPUT, and writes "LINE<tab>Type: message" of
# what fails there (the innermost line of the script in the traceback) to a report file: the script's own
# output cannot be mistaken for it.
IMPORT_RUNNER = """
import sys, traceback, types
draft, name, report = sys.argv[1:]
module = sys.modules["ejected"] = types.ModuleType("ejected")
module.__file__, sys.argv = name, [name]
try:
    exec(compile(open(draft, encoding="utf-8").read(), name, "exec"), module.__dict__)
except BaseException as err:
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == name]
    message = (str(err).splitlines() or [""])[0]
    with open(report, "w", encoding="utf-8") as f:
        print(lines[-1] if lines else 0, type(err).__name__ + (": " + message if message else ""), sep="\\t", file=f)
    sys.exit(1)
"""


def check_imports(script: Path, name: Path, timeout: float = 300) -> tuple[int, str] | None:
    """Run ``script``'s top level once, as an import of it under ``name`` would (its ``__main__`` block does not
    run), in an empty folder with nothing of the repository importable: (line, error) if it fails, else None."""
    with tempfile.TemporaryDirectory() as away:
        report = Path(away) / "report.txt"
        try:
            result = subprocess.run([sys.executable, "-c", IMPORT_RUNNER, str(script), str(name), str(report)],
                                    cwd=away, text=True, capture_output=True, stdin=subprocess.DEVNULL,
                                    timeout=timeout, env={**os.environ, "PYTHONPATH": ""})
        except subprocess.TimeoutExpired:
            raise EjectError(f"the ejected script's top level did not finish in {timeout:.0f} s when imported (does it "
                             "wait for input, or start work that does not end?)") from None
        if result.returncode == 0:
            return None
        line, _, error = report.read_text().strip().partition("\t") if report.is_file() else ("0", "", "")
    return int(line), error or (result.stderr.strip().splitlines() or ["it exits with an error"])[-1]


def ejected(path: Path) -> bool:
    """Whether ``path`` is a copy this script wrote (its header says so), edited since or not."""
    header = r"^# Generated by scripts/eject\.py from "  # a line of its own: eject.py holds the text too
    return re.search(header, path.read_text(encoding="utf-8", errors="replace"), re.MULTILINE) is not None


def remove_abandoned(target: Path) -> None:
    """Remove the drafts of ejects to ``target`` that were killed mid-way: a kill -9 (the OOM killer's) runs no
    clean-up. A draft is named for its process (.NAME.PID.xxxxxxxxxxxx.tmp), so one whose process is gone goes."""
    name = re.compile(rf"\.{re.escape(target.name[:40])}\.(\d+)\.[0-9a-f]{{12}}\.tmp")  # as main names its draft
    with contextlib.suppress(OSError):  # (a folder that may be written but not listed: nothing to sweep then)
        for draft in list(target.parent.iterdir()):
            if (found := name.fullmatch(draft.name)) and draft.is_file() and not draft.is_symlink() and \
                    not running(int(found[1])):
                draft.unlink(missing_ok=True)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 sends nothing; a system without it is assumed to run it)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (a number past any process's)
        return False
    except OSError:  # another user's
        return True
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP as Ctrl-C: the draft beside OUTPUT goes on the way out, as it did not."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def terminate(signum, frame) -> None:
    raise Terminated(signum)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block; exit 2 like every usage error
        print(f"error: {message} (usage: python scripts/eject.py RECIPE OUTPUT [--overwrite])", file=sys.stderr)
        sys.exit(2)


def given_path(value: str) -> str:
    """A path argument; an empty one (an unset shell variable, say) is refused rather than read as '.'."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    return value


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a path an ASCII-only terminal cannot show prints as \xfc, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = Parser(prog="scripts/eject.py", description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("recipe", type=given_path, help="a recipe's name (mnist_onecycle) or the path of a recipe file")
    parser.add_argument("output", type=given_path, help="the script to write, e.g. my_train.py")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (your edits in it too)")
    args = parser.parse_args(argv)
    recipe, output = Path(args.recipe), Path(args.output)
    if not recipe.is_file():  # a name: mnist_onecycle
        recipe = ROOT / "recipes" / f"{args.recipe.removesuffix('.py')}.py"
    if not recipe.is_file():
        known = ", ".join(sorted(path.stem for path in (ROOT / "recipes").glob("*.py")))
        parser.error(f"no recipe {args.recipe!r}; give one of {known}, or the path of a recipe file")
    draft = None
    try:
        if ejected(recipe):  # an earlier copy, edits and all, would be copied again into a muddle
            raise EjectError(f"{recipe} is a copy eject wrote, not a recipe; eject the recipe it came from")
        if output.is_dir() or args.output.endswith(("/", os.sep)):  # Path("new/") is "new": a file it would write
            what = "is a folder" if output.is_dir() else "names a folder (it ends in a slash)"
            raise EjectError(f"{output} {what}; give the path of the script to write, e.g. {output / 'train.py'}")
        if not output.parent.is_dir():
            missing = next(p for p in output.parents if not p.is_dir())  # the first folder missing, or a file
            what = "is a file" if missing.exists() else "does not exist"
            raise EjectError(f"cannot write {output}: {missing} {what}")
        if output.exists() and not output.is_file():  # /dev/null, a pipe: replaced, or read for ever
            raise EjectError(f"{output} is not a regular file; give the path of the script to write")
        if output.resolve() == recipe.resolve():
            raise EjectError(f"{output} is the recipe itself; write the script somewhere else")
        home, core, recipes = output.resolve().parent, (ROOT / "common").resolve(), (ROOT / "recipes").resolve()
        ours = output.exists() and home.is_relative_to(ROOT) and not ejected(output)  # README.md, say
        if home in (core, recipes) or ours:  # a new file in recipes/ would be taken for a recipe
            part = {core: "the core the recipes import", recipes: "another recipe" if output.exists() else
                    "the recipes' folder"}.get(home, "not a copy eject wrote")
            raise EjectError(f"{output} is part of this repository ({part}); write the script somewhere else")
        package = ROOT / output.stem  # modules without an __init__.py: a scripts.py beside them is found first
        if home == ROOT and not (package / "__init__.py").exists() and any(package.glob("*.py")):
            raise EjectError(f"{output} would hide this repository's {output.stem}/ from its tools' imports; write "
                             "the script somewhere else")
        if output.exists() and not args.overwrite:  # it may be a copy the user has edited since
            raise EjectError(f"{output} exists; choose another name, or add --overwrite to replace it")
        # Python puts a script's folder first on sys.path: a typer.py would be what its own `import typer` finds
        module, places = output.name.removesuffix(".py"), [p for p in sys.path if p and Path(p).resolve() != HERE]
        # (but test.py, a common name: the standard library's `test` is CPython's own suite, which nothing imports)
        if module.isidentifier() and module != "test" and (module in sys.stdlib_module_names or
                                                            PathFinder.find_spec(module, places)):
            raise EjectError(f"{output.name} would hide the {module} module from the script (Python looks in "
                             "the script's folder first); choose another name")
        ejection = Ejection(recipe)
        target = output.resolve()  # through a symbolic link: the file it points to is replaced
        remove_abandoned(target)
        # named before it is made (mkstemp names it after): a SIGTERM at any moment from here finds it to remove
        draft = target.with_name(f".{target.name[:40]}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        with open(draft, "x", encoding="utf-8", newline="\n") as f:  # "x": made new, with the usual mode
            f.write(ejection.text(output.name))
        if failure := check_imports(draft, output):
            raise EjectError(ejection.import_failure(*failure))
        if target.exists():
            shutil.copymode(target, draft)  # an executable copy stays executable
        os.replace(draft, target)  # only a script that imports replaces OUTPUT, whole
        draft = None
    except EjectError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # the draft beside OUTPUT is named as OUTPUT: the user never asked for that file
        about = f"cannot write {output}" if err.filename is None or str(err.filename).endswith(".tmp") else err.filename
        print(f"error: {about}: {err.strerror or err}", file=sys.stderr)
        return 1
    except RuntimeError as err:  # Path.resolve's, of a link that points at itself (Python 3.11)
        if not str(err).startswith("Symlink loop"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C; SIGTERM or SIGHUP too (a scheduler's, a closed terminal's)
        stopped = isinstance(err, Terminated)
        print(f"error: {'terminated' if stopped else 'interrupted'}; {output} left as it was", file=sys.stderr)
        return 128 + err.signum if stopped else 130
    finally:
        if draft is not None:
            draft.unlink(missing_ok=True)
    modules = ", ".join(Path(source.label).stem for source, _ in ejection.sections)
    print(f"wrote {output}: {ejection.label} with {len(ejection.taken)} definitions from {CORE}/ ({modules})")
    return 0


if __name__ == "__main__":
    for stop in ("SIGTERM", "SIGHUP"):  # (Windows has no SIGHUP); under nohup, SIGHUP stays ignored
        if hasattr(signal, stop) and signal.getsignal(getattr(signal, stop)) is not signal.SIG_IGN:
            signal.signal(getattr(signal, stop), terminate)
    sys.exit(main())
