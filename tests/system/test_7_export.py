"""`providerctl export kubernetes` from the installed package: it runs with the .deb's
dependencies alone (no YAML or Kubernetes library in the container)."""

from __future__ import annotations

from .nspawn import Container


def test_installed_export_runs_without_extra_dependencies(ct: Container) -> None:
    assert ct.sh("python3 -c 'import yaml'", check=False).rc != 0, "PyYAML is not a dependency"
    r = ct.sh(
        "providerctl export kubernetes /usr/share/doc/providerd/examples/demo.toml"
        " --image registry.example/demo:1 --namespace ml",
        check=False,
    )
    assert r.rc == 0, r.err
    assert "kind: Deployment" in r.out and "kind: HTTPRoute" in r.out
    assert "namespace: ml" in r.out
    assert "demo.toml: limits.tasks_max: not carried by Kubernetes: " in r.err
    r = ct.sh("providerctl export kubernetes /nonexistent.toml --image x", check=False)
    assert r.rc == 4 and "Traceback" not in r.err


def test_export_is_in_the_manual(ct: Container) -> None:
    assert ct.sh("test -e /usr/share/doc/providerd/kubernetes.md.gz", check=False).rc == 0
    assert "export kubernetes" in ct.sh("zcat /usr/share/man/man1/providerctl.1.gz").out
