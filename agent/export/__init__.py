"""Exports of provider manifests to other engines (`providerctl export`).

Reads only the spec side (`agent.spec.provider`, `agent.spec.manifest`, `agent.spec.keys`, `agent.spec.values`):
nothing here imports the front, the data path or the GPU code.
"""
