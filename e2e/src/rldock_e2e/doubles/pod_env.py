"""A container's environment as a kubelet computes it, for the kubelet and node agent doubles.

Order and rules as in the kubelet (pkg/kubelet/kubelet_pods.go makeEnvironmentVariables): the
image's variables, then `envFrom` (ConfigMaps and Secrets, with an optional prefix), then `env`,
later entries winning; `$(NAME)` in a value refers to a variable defined before it (`$$` is a
literal `$`); `valueFrom` reads a Secret or ConfigMap key, a field of the pod, or a resource
amount. Service-link variables (`<SVC>_SERVICE_HOST`, ...) are not made: nothing here needs them.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.utils import parse_quantity

# name -> the object's `data` (Secret values still base64), or None when it does not exist.
Lookup = Callable[[str], Mapping[str, str] | None]

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class MissingReference(LookupError):
    """A required Secret/ConfigMap (or key) is absent: the kubelet keeps the container waiting
    with reason CreateContainerConfigError."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined references replaced, others kept, `$$` -> `$`."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, text)


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    config_map: Lookup,
    secret: Lookup,
    pod_ip: str = "",
    host_ip: str = "",
    image_env: Mapping[str, str] = (),
) -> dict[str, str]:
    env: dict[str, str] = dict(image_env)
    for source in container.get("envFrom") or ():
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = _data(config_map, source["configMapRef"], decode=False)
        else:
            data = _data(secret, source["secretRef"], decode=True)
        env.update({prefix + key: value for key, value in data.items()})
    for var in container.get("env") or ():
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        value = _value_from(
            source, pod, container, config_map=config_map, secret=secret, pod_ip=pod_ip, host_ip=host_ip
        )
        if value is not None:
            env[var["name"]] = value
    return env


def _data(lookup: Lookup, ref: Mapping[str, Any], *, decode: bool) -> dict[str, str]:
    data = lookup(ref["name"])
    if data is None:
        if ref.get("optional"):
            return {}
        raise MissingReference(f"{'secret' if decode else 'configmap'} {ref['name']!r} not found")
    return {k: base64.b64decode(v).decode() if decode else v for k, v in data.items()}


def _value_from(
    source: Mapping[str, Any],
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    config_map: Lookup,
    secret: Lookup,
    pod_ip: str,
    host_ip: str,
) -> str | None:
    for kind, lookup, decode in (("configMapKeyRef", config_map, False), ("secretKeyRef", secret, True)):
        if kind in source:
            ref = source[kind]
            data = _data(lookup, ref, decode=decode)
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise MissingReference(f"key {ref['key']!r} not in {ref['name']!r}")
            return data[ref["key"]]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
    if "resourceFieldRef" in source:
        ref = source["resourceFieldRef"]
        section, _, name = ref["resource"].partition(".")
        amount = (container.get("resources", {}).get(section) or {}).get(name)
        if amount is None:
            return "0"
        divisor = parse_quantity(ref.get("divisor", "1"))
        return str(math.ceil(parse_quantity(amount) / divisor))
    raise ValueError(f"unsupported valueFrom: {json.dumps(source)}")


def field_value(pod: Mapping[str, Any], path: str, *, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    labelled = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if labelled:
        return (meta.get(labelled.group(1)) or {}).get(labelled.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
    }
    if path not in simple:
        raise ValueError(f"unsupported fieldRef {path!r}")
    return simple[path]
