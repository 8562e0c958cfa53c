"""The accuracy harness's report of kernels a server compiled while serving
(vllm_sparse_tools/evaluation/triton_cache.py), on a cache laid out as Triton 3.x writes
it: one folder per compile with NAME.json (metadata with "name"), NAME.ttir and a __grp__ file."""

from __future__ import annotations

import json

from vllm_sparse_tools.evaluation.triton_cache import compiled_since, describe, snapshot


def _compile(root, key, name, args):
    folder = root / key
    folder.mkdir(parents=True)
    (folder / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 8}))
    (folder / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    decl = ", ".join(f'%{a}: {t} loc("{a}"(#loc))' for a, t in args)
    (folder / f"{name}.ttir").write_text(
        f'#loc = loc("k.py":1:0)\nmodule {{\n  tt.func public @{name}({decl}) attributes {{noinline = false}} {{\n'
        "    tt.return loc(#loc1)\n  } loc(#loc)\n} loc(#loc)\n")


PTR = "!tt.ptr<bf16> {tt.divisibility = 16 : i32}"
DIV = "i32 {tt.divisibility = 16 : i32}"


def test_names_new_compiles_and_the_arguments_specialised_differently(tmp_path):
    _compile(tmp_path, "A1", "_attn", [("q_ptr", PTR), ("s_bt", DIV), ("n", "i32")])
    _compile(tmp_path, "B1", "_est", [("k_ptr", PTR)])
    before = snapshot(tmp_path)
    assert before == {"A1", "B1"}
    assert compiled_since(tmp_path, before) == []
    _compile(tmp_path, "A2", "_attn", [("q_ptr", PTR), ("s_bt", "i32"), ("n", "i32")])  # s_bt no longer % 16
    _compile(tmp_path, "B2", "_est", [("k_ptr", PTR)])  # same signature: a constexpr changed
    _compile(tmp_path, "C1", "_topk", [("x_ptr", PTR)])  # never compiled before
    new = compiled_since(tmp_path, before)
    assert new == [{"name": "_attn", "differs": [f"%s_bt: {DIV} -> %s_bt: i32"]},
                   {"name": "_est", "differs": []},
                   {"name": "_topk", "differs": None}]
    assert describe(new).splitlines() == [f"_attn: %s_bt: {DIV} -> %s_bt: i32",
                                          "_est: same signature, other constexpr values",
                                          "_topk: first compile"]
    assert describe([]) == "no kernel compiled"


def test_a_missing_cache_folder_is_empty(tmp_path):
    assert snapshot(tmp_path / "nowhere") == set()
    assert compiled_since(tmp_path / "nowhere", set()) == []
