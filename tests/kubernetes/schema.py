"""Validate Kubernetes objects offline, as strictly as an API server would without being one.

- Built-in kinds (Deployment, Service, NetworkPolicy): `kubernetes-validate`'s bundled
  official schemas, strict mode (unknown fields refused), for every version in VERSIONS.
- Custom resources (InterceptorRoute, ScaledObject, HTTPRoute, ReferenceGrant): the
  vendored CRDs' `openAPIV3Schema` (crds/SOURCES.md), walked with the structural-schema
  rules of the API server: unknown fields refused (like `fieldValidation=Strict`), schema
  defaults applied first, types, int-or-string, nullable, enums, patterns, lengths, bounds,
  int32/int64 formats, list-type map/set uniqueness; then every `x-kubernetes-validations`
  CEL rule is evaluated with cel-python on the defaulted object. A rule that needs a
  Kubernetes-only CEL function, or a transition rule (`oldSelf`, not run on create), is
  collected as not checked: never counted as passed.

Not done here (a running API server would): ObjectMeta beyond name, namespace, labels and
annotations; admission; server-side defaulting of built-in kinds; controllers.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import yaml

CRDS = Path(__file__).resolve().parent / "crds"
VERSIONS = ("1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
BUILTIN = {("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy")}

# CEL functions the API server adds to standard CEL (Kubernetes CEL libraries); a rule
# that calls one cannot be evaluated by cel-python.
K8S_ONLY_FUNCTIONS = (
    "isSorted",
    "sum",
    "indexOf",
    "lastIndexOf",
    "url",
    "isURL",
    "getScheme",
    "getHost",
    "quantity",
    "isQuantity",
    "ip",
    "isIP",
    "cidr",
    "isCIDR",
    "format",
    "lowerAscii",
    "upperAscii",
    "replace",
    "split",
    "join",
    "substring",
    "trim",
    "charAt",
    "reverse",
    "find",
    "findAll",
    "semver",
    "isSemver",
)
_K8S_CALL = re.compile(
    r"\.(" + "|".join(K8S_ONLY_FUNCTIONS) + r")\(|\b(" + "|".join(K8S_ONLY_FUNCTIONS) + r")\("
)
# Property names the API server escapes for CEL (apiextensions CEL property names).
_CEL_RESERVED = frozenset(
    [
        "true",
        "false",
        "null",
        "in",
        "as",
        "break",
        "const",
        "continue",
        "else",
        "for",
        "function",
        "if",
        "import",
        "let",
        "loop",
        "package",
        "namespace",
        "return",
        "var",
        "void",
        "while",
    ]
)
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    rules_passed: int = 0
    not_checked: list[str] = field(default_factory=list)  # "<kind> <path>: <rule>: <why>"

    def merge(self, other: Report) -> None:
        self.errors += other.errors
        self.rules_passed += other.rules_passed
        self.not_checked += other.not_checked


# -- CRDs ----------------------------------------------------------------------------------


@cache
def crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → openAPIV3Schema, from every vendored CRD."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


# -- the structural walker -------------------------------------------------------------------


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    if value is None:
        return bool(schema.get("nullable"))
    if schema.get("x-kubernetes-int-or-string"):
        return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
    kind = schema.get("type")
    return {
        None: True,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
    }[kind]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """The value with every schema default filled in, top-down, as the API server does."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, item in value.items():
            if name in props:
                value[name] = apply_defaults(item, props[name])
            elif isinstance(schema.get("additionalProperties"), dict):
                value[name] = apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _cel_value(value: Any, schema: dict[str, Any]) -> Any:
    """The value as CEL sees it: property names escaped the API server's way."""
    if isinstance(value, dict):
        props = schema.get("properties")
        out = {}
        for name, item in value.items():
            sub = (props or {}).get(name) or schema.get("additionalProperties") or {}
            key = _escape(name) if props is not None else name
            out[key] = _cel_value(item, sub if isinstance(sub, dict) else {})
        return out
    if isinstance(value, list):
        items = schema.get("items", {})
        return [_cel_value(item, items) for item in value]
    return value


def _escape(name: str) -> str:
    if name in _CEL_RESERVED:
        return f"__{name}__"
    return (
        name.replace("__", "__underscores__")
        .replace(".", "__dot__")
        .replace("-", "__dash__")
        .replace("/", "__slash__")
    )


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _run_rules(value: Any, schema: dict[str, Any], where: str, report: Report) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        text = rule["rule"]
        if "oldSelf" in text:
            report.not_checked.append(f"{where}: {text!r}: a transition rule (not run on create)")
            continue
        if m := _K8S_CALL.search(text):
            name = m.group(1) or m.group(2)
            report.not_checked.append(f"{where}: {text!r}: Kubernetes-only function {name}()")
            continue
        try:
            result = _program(text).evaluate({"self": celpy.json_to_cel(_cel_value(value, schema))})
        except Exception as e:  # cel-python's own errors: reported, never passed
            report.not_checked.append(f"{where}: {text!r}: cel-python could not evaluate it: {e}")
            continue
        if isinstance(result, Exception) or not isinstance(result, celpy.celtypes.BoolType):
            report.not_checked.append(f"{where}: {text!r}: evaluated to {result!r}")
        elif bool(result):
            report.rules_passed += 1
        else:
            report.errors.append(f"{where}: {rule.get('message', text)} (rule {text!r})")


def _check_format(value: Any, schema: dict[str, Any], where: str, report: Report) -> None:
    fmt = schema.get("format")
    if isinstance(value, int) and not isinstance(value, bool):
        bits = {"int32": 31, "int64": 63}.get(fmt or "")
        if bits and not -(1 << bits) <= value < (1 << bits):
            report.errors.append(f"{where}: {value} is out of the {fmt} range")


def walk(value: Any, schema: dict[str, Any], where: str, report: Report) -> None:
    """Check one (already defaulted) value against its structural schema."""
    if not _type_ok(value, schema):
        kind = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        report.errors.append(f"{where}: expected {kind}, got {type(value).__name__}")
        return
    if value is None:
        return
    if "enum" in schema and value not in schema["enum"]:
        report.errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            report.errors.append(f"{where}: longer than {schema['maxLength']} characters")
        if "minLength" in schema and len(value) < schema["minLength"]:
            report.errors.append(f"{where}: shorter than {schema['minLength']} characters")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            report.errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            report.errors.append(f"{where}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            report.errors.append(f"{where}: {value} is above the maximum {schema['maximum']}")
        _check_format(value, schema, where, report)
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            report.errors.append(f"{where}: more than {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            report.errors.append(f"{where}: fewer than {schema['minItems']} items")
        _check_list_type(value, schema, where, report)
        for i, item in enumerate(value):
            walk(item, schema.get("items", {}), f"{where}[{i}]", report)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for name in schema.get("required", []):
            if name not in value:
                report.errors.append(f"{where}: required field {name!r} is missing")
        for name, item in value.items():
            if props is not None and name in props:
                walk(item, props[name], f"{where}.{name}", report)
            elif isinstance(extra, dict):
                walk(item, extra, f"{where}.{name}", report)
            elif not (schema.get("x-kubernetes-preserve-unknown-fields") or extra is True) and (
                props is not None or extra is False
            ):
                report.errors.append(f"{where}: unknown field {name!r}")
    _run_rules(value, schema, where, report)


def _check_list_type(value: list[Any], schema: dict[str, Any], where: str, report: Report) -> None:
    kind = schema.get("x-kubernetes-list-type")
    if kind == "set" and len({repr(v) for v in value}) != len(value):
        report.errors.append(f"{where}: duplicate items in a list-type set")
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
        if len(set(seen)) != len(seen):
            report.errors.append(f"{where}: duplicate map keys {keys} in a list-type map")


# -- metadata ------------------------------------------------------------------------------


def _check_key(key: str, where: str, report: Report) -> None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        report.errors.append(f"{where}: key prefix {prefix!r} is not a DNS subdomain")
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        report.errors.append(f"{where}: key name {name!r} is not a qualified name")


def check_metadata(obj: dict[str, Any], where: str, report: Report) -> None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        report.errors.append(f"{where}: metadata is missing")
        return
    name, namespace = meta.get("name", ""), meta.get("namespace", "")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        report.errors.append(f"{where}: metadata.name {name!r} is not a DNS subdomain")
    if not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_LABEL.fullmatch(namespace):
        report.errors.append(f"{where}: metadata.namespace {namespace!r} is not a DNS label")
    for key, val in (meta.get("labels") or {}).items():
        _check_key(key, f"{where}: metadata.labels", report)
        if not isinstance(val, str) or len(val) > 63 or (val and not _LABEL_NAME.fullmatch(val)):
            report.errors.append(
                f"{where}: metadata.labels[{key!r}] = {val!r} is not a label value"
            )
    for key, val in (meta.get("annotations") or {}).items():
        _check_key(key, f"{where}: metadata.annotations", report)
        if not isinstance(val, str):
            report.errors.append(f"{where}: metadata.annotations[{key!r}] is not a string")
    unknown = set(meta) - {"name", "namespace", "labels", "annotations"}
    if unknown:
        report.errors.append(
            f"{where}: metadata has fields the export never writes: {sorted(unknown)}"
        )


# -- one object, many objects --------------------------------------------------------------


def validate_object(obj: dict[str, Any], versions: tuple[str, ...] = VERSIONS) -> Report:
    report = Report()
    api, kind = obj.get("apiVersion"), obj.get("kind")
    where = f"{kind} {obj.get('metadata', {}).get('name')}"
    check_metadata(obj, where, report)
    if (api, kind) in BUILTIN:
        for version in versions:
            try:
                kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
            except kubernetes_validate.ValidationError as e:
                report.errors.append(
                    f"{where} (Kubernetes {version}): {e.message} at {list(e.path)}"
                )
        return report
    schema = crds().get((str(api), str(kind)))
    if schema is None:
        report.errors.append(f"{where}: no schema for {api} {kind}")
        return report
    defaulted = apply_defaults(copy.deepcopy(obj), schema)
    walk(defaulted, schema, where, report)
    return report


def validate_all(objects: list[dict[str, Any]], versions: tuple[str, ...] = VERSIONS) -> Report:
    report = Report()
    for obj in objects:
        report.merge(validate_object(obj, versions))
    return report
