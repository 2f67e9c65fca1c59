"""Exports of provider manifests to other engines (`providerctl export`).

Reads only the spec side (`agent.model`, `agent.manifest`, `agent.keys`, `agent.values`):
nothing here imports the front, the data path or the GPU code.
"""
