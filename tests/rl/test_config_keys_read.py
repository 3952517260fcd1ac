"""Every key the config accepts is read by the code that runs: a key nothing reads is a promise the
trainer does not keep (``critic.off_policy_correction`` and ``critic.importance_weight_cap`` were two,
published in docs/rl/config.md and read by nobody).

The check is an ast scan of rl_extension outside config/ (the config's own checks do not count as
use). A leaf key ``Section.name`` is read where the code accesses ``.name`` on something of that
section: a parameter or variable annotated with the section's class, a ``self.x`` set from one, or a
``<anything>.<section field>`` such as ``config.critic``. Where the scan cannot tell what a receiver
is, ``.name`` counts for every section with that key (lenient: no false alarm, and a key that only a
known receiver of another section reads is still caught); so does a string equal to the name
(``getattr(config, "name")``, an estimator's ``config_keys=("gamma",)``).

Run: python -m pytest tests/rl/test_config_keys_read.py -q
"""

import ast
import dataclasses
import pathlib
from collections import defaultdict

from rl_extension.config import CriticConfig, PPOConfig, SFTConfig
from rl_extension.config.schema import field_types

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p for p in (ROOT / "rl_extension").rglob("*.py") if "config" not in p.relative_to(ROOT).parts
)

# Keys read without their name in the code; each says how it is read.
READ_INDIRECTLY = {
    "ActorConfig.always_compute_old_log_prob": "through PPOConfig.compute_old_log_prob, which the trainer reads",
    "ActorConfig.ppo_mini_batch_size": "through PPOConfig.num_actor_mini_batches (the actor's optimizer steps)",
    "PPOConfig.imports": "imported by PPOConfig.validate, before the names they register are checked",
    "SFTConfig.imports": "imported by SFTConfig.validate, as PPOConfig's",
}

Key = tuple[type, str]  # the class that declares the field, and its name


def _sections(roots: tuple[type, ...]) -> set[type]:
    """Every config dataclass reachable from ``roots``."""
    seen: set[type] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo += [tp for tp in field_types(cls).values() if dataclasses.is_dataclass(tp)]
    return seen


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares the field ``name`` (OptimizerConfig for actor.lr)."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def _leaf_keys(sections: set[type]) -> set[Key]:
    return {
        (_owner(cls, name), name)
        for cls in sections
        for name, tp in field_types(cls).items()
        if not dataclasses.is_dataclass(tp)
    }


class _Reads(ast.NodeVisitor):
    """Collects, in one module, the leaf keys it reads (see the module docstring for the rules)."""

    def __init__(self, sections: set[type], keys: set[Key], reads: set[Key]):
        self.by_class_name = {cls.__name__: cls for cls in sections}
        self.section_fields: dict[str, set[type]] = defaultdict(set)  # "critic" -> {CriticConfig}
        for cls in sections:
            for name, tp in field_types(cls).items():
                if dataclasses.is_dataclass(tp):
                    self.section_fields[name].add(tp)
        self.owners_of: dict[str, set[type]] = defaultdict(set)  # "lr" -> {OptimizerConfig}
        for owner, name in keys:
            self.owners_of[name].add(owner)
        self.reads = reads
        self.variables: list[dict[str, set[type]]] = [{}]  # a scope per function
        self.self_attributes: list[dict[str, set[type]]] = [{}]  # a scope per class

    def _classes_in(self, annotation: ast.expr | None) -> set[type]:
        """The config classes an annotation names (``CriticConfig``, ``ActorConfig | None``, "ActorConfig")."""
        if annotation is None:
            return set()
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return set()
        names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
        return {self.by_class_name[n] for n in names if n in self.by_class_name}

    def _classes_of(self, expr: ast.expr) -> set[type]:
        """The config classes ``expr`` holds, as far as the scan can tell (empty: unknown)."""
        if isinstance(expr, ast.Name):
            return self.variables[-1].get(expr.id, set())
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id == "self":
                known = self.self_attributes[-1].get(expr.attr)
                if known:
                    return known
            return self.section_fields.get(expr.attr, set())
        return set()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        attributes: dict[str, set[type]] = {}
        for item in ast.walk(node):  # self.x = <a parameter annotated with a config class>
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                params = {a.arg: self._classes_in(a.annotation) for a in _arguments(item)}
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Name):
                        for target in sub.targets:
                            if _is_self_attribute(target) and params.get(sub.value.id):
                                attributes.setdefault(target.attr, set()).update(params[sub.value.id])
            if isinstance(item, ast.AnnAssign) and _is_self_attribute(item.target):
                attributes.setdefault(item.target.attr, set()).update(self._classes_in(item.annotation))
        self.self_attributes.append({k: v for k, v in attributes.items() if v})
        self.generic_visit(node)
        self.self_attributes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = dict(self.variables[-1])
        for arg in _arguments(node):
            scope[arg.arg] = self._classes_in(arg.annotation)
        for sub in ast.walk(node):
            if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                scope[sub.target.id] = self._classes_in(sub.annotation)
            elif (
                isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name)
            ):
                known = self._classes_of(sub.value)  # cfg = self.config / c = config.critic
                if known:
                    scope[sub.targets[0].id] = known
        self.variables.append(scope)
        self.generic_visit(node)
        self.variables.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owners = self.owners_of.get(node.attr)
        if owners:
            known = self._classes_of(node.value)
            if known:
                owners = {o for o in owners if any(issubclass(cls, o) for cls in known)}
            self.reads.update((owner, node.attr) for owner in owners)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self.reads.update((owner, node.value) for owner in self.owners_of.get(node.value, ()))


def _arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]


def _is_self_attribute(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def unread_keys(roots: tuple[type, ...] = (PPOConfig, SFTConfig)) -> list[str]:
    """``Section.key`` for each leaf key of the configs ``roots`` that no module of rl_extension
    outside config/ reads (the allow-list aside)."""
    sections = _sections(roots)
    keys = _leaf_keys(sections)
    reads: set[Key] = set()
    for path in SOURCES:
        _Reads(sections, keys, reads).visit(ast.parse(path.read_text(), str(path)))
    unread = {f"{owner.__name__}.{name}" for owner, name in keys - reads}
    return sorted(unread - set(READ_INDIRECTLY))


def test_every_config_key_is_read_by_the_code_that_runs():
    assert unread_keys() == [], (
        "config keys that no code outside rl_extension/config reads: remove them, or read them "
        "(a key read without its name goes in READ_INDIRECTLY, saying how)"
    )


def test_the_scan_catches_a_key_that_only_another_section_reads():
    """The two critic keys as they were: the actor's keys of the same names are read, the critic's never."""

    @dataclasses.dataclass(kw_only=True)
    class OldCriticConfig(CriticConfig):
        off_policy_correction: str = "none"
        importance_weight_cap: float = 2.0

    @dataclasses.dataclass(kw_only=True)
    class OldPPOConfig(PPOConfig):
        critic: OldCriticConfig = dataclasses.field(default_factory=OldCriticConfig)

    assert unread_keys((OldPPOConfig,)) == [
        "OldCriticConfig.importance_weight_cap",
        "OldCriticConfig.off_policy_correction",
    ]


def test_every_allow_listed_key_exists():
    keys = {f"{owner.__name__}.{name}" for owner, name in _leaf_keys(_sections((PPOConfig, SFTConfig)))}
    assert set(READ_INDIRECTLY) <= keys
