"""optimizer.contract(): frozen, versioned, and what COMPATIBILITY.md says."""

import dataclasses
import json
import os

import pytest
import torch

import gefen
from gefen.contract import CONTRACT_VERSION, transitions_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _optimizers():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return [gefen.Gefen(m.parameters()), gefen.GefenMuon([m[0].weight]), gefen.GefenMuonHybrid(m, lr=1e-3)]


@pytest.mark.parametrize("opt", _optimizers(), ids=["gefen", "gefen_muon", "hybrid"])
def test_contract_is_frozen_versioned_and_serialisable(opt):
    c = opt.contract()
    assert c.version == CONTRACT_VERSION and c.schema == 2
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign"):
        c.kind = "other"
    d = json.loads(json.dumps(c.as_dict()))
    assert {"version", "kind", "schema", "state", "layouts", "transitions"} <= set(d)
    names = {f["name"] for f in d["state"]}
    assert {"codes", "magnitude", "codebook", "digest_rows", "period"} <= names
    assert all(t["tests"] for t in d["transitions"])


def test_state_fields_are_what_a_state_dict_holds():
    p = torch.nn.Parameter(torch.randn(8, 16))
    for opt in (gefen.Gefen([p]), gefen.Gefen([p], factored=False), gefen.GefenMuon([p], normuon=True)):
        p.grad = torch.randn_like(p)
        opt.step()
        declared = {f.name for f in opt.contract().state}
        saved = set(opt.state_dict()["state"][0])
        assert saved <= declared, saved - declared


def test_compatibility_table_is_generated_from_the_contract():
    with open(os.path.join(ROOT, "COMPATIBILITY.md"), encoding="utf-8") as f:
        doc = f.read()
    begin, end = "<!-- contract:begin -->\n", "<!-- contract:end -->"
    assert begin in doc and end in doc
    table = doc[doc.index(begin) + len(begin): doc.index(end)]
    assert table == transitions_markdown(), "regenerate with: python -m gefen.contract"


def test_every_declared_transition_names_existing_tests():
    import test_compatibility_doc as doc

    for t in gefen.Gefen([torch.nn.Parameter(torch.zeros(2, 2))]).contract().transitions:
        for ref in t.tests:
            path, _, name = ref.partition("::")
            assert doc._exists(path, name or None), ref
