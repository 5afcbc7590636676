import json
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)

from grpo_hf.compression import CodecSpec, compression_plan
from grpo_hf.compression.plan import default_bits
from grpo_hf.grouping import (
    GroupConfigError,
    GroupRule,
    GroupSpec,
    assign_groups,
    group_table,
    load_group_spec,
    parse_group_config,
    shape_kind,
)


ARTICLE_CONFIG = """{
  "groups": [
    {"name": "attention_qk", "pattern": "self_attn.*q_proj", "sparsity": 0.2},
    {"name": "ffn_intermediate", "pattern": "ffn.*intermediate", "sparsity": 0.35}
  ]
}"""


@pytest.fixture
def llama(tiny_model):
    """A factory of tiny Llamas smaller than the default (vocabulary 64, hidden 16)."""
    return lambda: tiny_model(vocab_size=64, hidden_size=16, intermediate_size=32)


def groups_of(model, spec="semantic"):
    return {g.name: g.param_names for g in assign_groups(model, load_group_spec(spec))}


def test_llama_semantic_groups(llama):
    groups = groups_of(llama())
    assert list(groups) == ["embeddings", "norms", "attn_qk", "attn_vo", "ffn"]
    assert groups["embeddings"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert groups["attn_qk"] == [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qk"]
    assert groups["attn_vo"] == [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "vo"]
    assert len(groups["ffn"]) == 6 and all(".mlp." in n for n in groups["ffn"])
    assert groups["norms"][-1] == "model.norm.weight" and len(groups["norms"]) == 5


def test_gpt2_fused_qkv_and_tied_head():
    groups = groups_of(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2)))
    assert groups["attn_qkv"] == [f"transformer.h.{i}.attn.c_attn.{w}" for i in range(2) for w in ("weight", "bias")]
    assert groups["attn_vo"] == [f"transformer.h.{i}.attn.c_proj.{w}" for i in range(2) for w in ("weight", "bias")]
    assert "transformer.h.0.mlp.c_proj.weight" in groups["ffn"]
    assert groups["embeddings"] == ["transformer.wte.weight", "transformer.wpe.weight"]  # lm_head is tied to wte
    assert "default" not in groups


def test_bert_groups():
    model = BertForSequenceClassification(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    groups = groups_of(model)
    prefix = "bert.encoder.layer.0."
    assert groups["attn_qk"] == [
        prefix + f"attention.self.{m}.{w}" for m in ("query", "key") for w in ("weight", "bias")
    ]
    assert prefix + "attention.output.dense.weight" in groups["attn_vo"]
    assert groups["ffn"] == [prefix + f"{m}.dense.{w}" for m in ("intermediate", "output") for w in ("weight", "bias")]
    assert prefix + "attention.output.LayerNorm.weight" in groups["norms"]
    assert groups["head"] == [
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "classifier.weight",
        "classifier.bias",
    ]


def test_t5_groups():
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    groups = groups_of(model)
    assert "encoder.block.0.layer.0.SelfAttention.q.weight" in groups["attn_qk"]
    assert "decoder.block.0.layer.1.EncDecAttention.k.weight" in groups["attn_qk"]
    assert "decoder.block.0.layer.1.EncDecAttention.o.weight" in groups["attn_vo"]
    assert "encoder.block.0.layer.1.DenseReluDense.wi.weight" in groups["ffn"]
    assert "shared.weight" in groups["embeddings"]
    assert "default" not in groups


def test_lora_groups_keep_layer_kind_and_skip_frozen(llama):
    model = get_peft_model(llama(), LoraConfig(r=2, target_modules="all-linear"))
    groups = groups_of(model)
    assert list(groups) == [
        "attn_qk.lora_A",
        "attn_vo.lora_A",
        "ffn.lora_A",
        "attn_qk.lora_B",
        "attn_vo.lora_B",
        "ffn.lora_B",
    ]
    assert groups["attn_qk.lora_A"][0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert all("base_layer" not in n for names in groups.values() for n in names)


def test_semantic_shape_split(llama):
    groups = groups_of(llama(), "semantic+shape")
    # q_proj is 16x16 (square); k_proj is 8x16 with 2 KV heads (rect); norms are vectors
    assert groups["attn_qk/square"] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert groups["attn_qk/rect"] == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ]
    assert "norms/vector" in groups
    assert shape_kind(torch.zeros(3)) == "vector" and shape_kind(torch.zeros(2, 3, 4)) == "rect"


def test_article_config_loads_verbatim(llama, tmp_path, caplog):
    path = tmp_path / "groups.json"
    path.write_text(ARTICLE_CONFIG)
    spec = load_group_spec(str(path))
    assert spec.rules == (
        GroupRule("attention_qk", "self_attn.*q_proj", density=0.2),
        GroupRule("ffn_intermediate", "ffn.*intermediate", density=0.35),
    )
    with caplog.at_level("WARNING"):
        groups = {g.name: g for g in assign_groups(llama(), spec)}
    assert groups["attention_qk"].param_names == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    assert "ffn_intermediate" not in groups and "ffn_intermediate" in caplog.text  # matches nothing on Llama
    assert len(groups["default"].params) == sum(1 for _ in llama().parameters()) - 2
    with pytest.raises(GroupConfigError, match="ffn_intermediate"):
        assign_groups(llama(), spec, strict=True)


def test_yaml_group_file(tmp_path):
    path = tmp_path / "groups.yaml"
    path.write_text("split_by_shape: true\ngroups:\n  - {name: qk, pattern: '(q|k)_proj', density: 0.1, bits: 8}\n")
    spec = load_group_spec(str(path))
    assert spec.split_by_shape and spec.rules[0] == GroupRule("qk", "(q|k)_proj", density=0.1, bits=8)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"name": "a", "pattern": "(unclosed"}, r"group 'a': invalid regular expression"),
        ({"name": "a", "pattern": "x", "density": 2}, r"outside \(0, 1\]"),
        ({"name": "a", "pattern": "x", "sparsity": 0}, r"outside \(0, 1\]"),
        ({"name": "a", "pattern": "x", "bits": 3}, r"bits=3 is not supported"),
        ({"name": "a", "pattern": "x", "density": 0.1, "sparsity": 0.1}, "both 'density' and 'sparsity'"),
        ({"name": "a", "pattern": "x", "sparsty": 0.1}, r"unknown key\(s\) \['sparsty'\]"),
        ({"name": "a"}, "missing required key 'pattern'"),
    ],
)
def test_bad_group_files_name_file_rule_and_fix(tmp_path, entry, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"groups": [entry]}))
    with pytest.raises(GroupConfigError, match=message) as err:
        load_group_spec(str(path))
    assert str(path) in str(err.value)


def test_duplicate_and_reserved_names(tmp_path):
    with pytest.raises(GroupConfigError, match=r"duplicate group name\(s\) \['a'\]"):
        load_group_spec({"groups": [{"name": "a", "pattern": "x"}, {"name": "a", "pattern": "y"}]})
    with pytest.raises(GroupConfigError, match="reserved"):
        load_group_spec({"groups": [{"name": "default", "pattern": "x"}]})
    with pytest.raises(GroupConfigError, match="neither a preset"):
        load_group_spec(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(GroupConfigError, match=r"broken.json: invalid JSON at line 1"):
        load_group_spec(str(tmp_path / "broken.json"))


def test_bits_by_module_type_and_dense_small_tensors():
    model = nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 128), nn.Conv1d(8, 8, 3), nn.LayerNorm(64))
    spec = GroupSpec((GroupRule("all", ".*"),))
    groups = assign_groups(model, spec)
    plan = compression_plan(model, groups, "sparse+quantize", density=0.15, bits="auto", min_numel=100)
    assert plan["0.weight"] == CodecSpec(0.15, 8)  # embedding
    assert plan["1.weight"] == CodecSpec(0.15, 4)  # linear
    assert plan["1.bias"] == CodecSpec(0.15, 4)  # 128 elements >= min_numel
    assert plan["2.weight"] == CodecSpec(0.15, 8)  # conv
    assert plan["2.bias"] is None and plan["3.weight"] is None  # tiny tensors go dense
    assert default_bits(None) == 4
    overridden = compression_plan(model, groups, "sparse+quantize", density=0.3, bits="16", min_numel=0)
    assert overridden["0.weight"] == CodecSpec(0.3, 16)


def test_group_rule_settings_override_config(llama):
    spec = GroupSpec((GroupRule("qk", "q_proj|k_proj", density=0.5, bits=8),))
    model = llama()
    groups = assign_groups(model, spec)
    plan = compression_plan(model, groups, "sparse+quantize", density=0.15, bits="auto", min_numel=0)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == CodecSpec(0.5, 8)
    assert plan["model.layers.0.mlp.up_proj.weight"] == CodecSpec(0.15, 4)
    rows = {r["group"]: r for r in group_table(groups, plan)}
    assert rows["qk"]["tensors"] == 4 and rows["qk"]["density"] == "0.5" and rows["qk"]["bits"] == "8"
    assert abs(sum(r["share"] for r in rows.values()) - 1) < 1e-12
    assert rows["qk"]["parameters"] == 2 * (16 * 16 + 8 * 16)


def test_no_trainable_parameters_is_an_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(GroupConfigError, match="no trainable parameter"):
        assign_groups(model, load_group_spec("semantic"))


def test_lr_ratios_come_from_rules_then_patterns(llama):
    from grpo_hf.grouping import lr_ratios

    spec = parse_group_config({"groups": [{"name": "qk", "pattern": "q_proj|k_proj", "lr_ratio": 2}]})
    groups = assign_groups(llama(), spec)
    ratios = lr_ratios(groups, {"q*": 9.0, "def*": 0.5})
    assert ratios == {"qk": 2.0, "default": 0.5}  # the rule's own ratio wins over a matching pattern
    assert lr_ratios(groups) == {"qk": 2.0, "default": 1.0}
    rows = {r["group"]: r for r in group_table(groups, None, {"default": 0.5})}
    assert rows["default"]["lr_ratio"] == 0.5 and rows["qk"]["lr_ratio"] == 2.0


def test_a_ratio_pattern_that_matches_no_group_warns(llama, caplog):
    from grpo_hf.grouping import lr_ratios

    groups = assign_groups(llama(), load_group_spec("semantic"))
    with caplog.at_level(logging.WARNING, logger="grpo_hf.grouping"):
        assert lr_ratios(groups, {"embeddings": 0.5}) == lr_ratios(groups, {"embedings": 0.5, "embeddings": 0.5})
    assert "grpo_lr_ratios: pattern(s) ['embedings'] match no group" in caplog.text
    assert caplog.text.count("match no group") == 1 and "'embeddings'" in caplog.text  # the groups are listed


@pytest.mark.parametrize("ratio", [0, -1, "2", True, float("inf")])
def test_bad_lr_ratio_in_a_group_file(ratio):
    with pytest.raises(GroupConfigError, match="'qk'.*lr_ratio"):
        parse_group_config({"groups": [{"name": "qk", "pattern": "q_proj", "lr_ratio": ratio}]}, "my.json")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("syntax.yaml", "groups:\n  - name: qk\n   pattern: q_proj\n", r"syntax.yaml: invalid YAML at line 3"),
        ("tag.yaml", "groups: !!python/object/apply:os.system ['true']\n", r"tag.yaml: unsupported YAML tag"),
        ("importance.yaml", "groups:\n  - {name: qk, pattern: q_proj, importance: sometimes}\n",
         r"importance.yaml: group 'qk': importance='sometimes' is not a boolean"),
        ("pattern.yaml", "groups:\n  - {name: qk, pattern: [q_proj]}\n", r"pattern.yaml: group 'qk': 'pattern' must be a string"),
        ("bits.yaml", "groups:\n  - {name: qk, pattern: q, bits: true}\n", r"bits.yaml: group 'qk': bits=True"),
        ("bounds.yaml", "groups:\n  - {name: qk, pattern: q, lr_scale_min: low}\n", r"bounds.yaml: group 'qk': lr_scale_min='low'"),
        ("shape.yaml", "groups: []\nsplit_by_shape: maybe\n", r"shape.yaml: split_by_shape='maybe' is not a boolean"),
        ("broken.json", '{"groups": [', r"broken.json: invalid JSON at line 1, column 13"),
    ],
)  # fmt: skip
def test_group_file_errors_name_the_file(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(GroupConfigError, match=message):
        load_group_spec(str(path))


def test_binary_group_file_is_named(tmp_path):
    path = tmp_path / "groups.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(GroupConfigError, match=r"groups.json: not a UTF-8 text file"):
        load_group_spec(str(path))


def test_group_file_without_rules_warns_that_everything_lands_in_default(tmp_path, caplog, tiny_model):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"groups": []}))
    with caplog.at_level("WARNING", logger="grpo_hf.grouping"):
        spec = load_group_spec(str(path))
    assert f"{path}: the 'groups' list is empty: every trainable parameter lands in the group 'default'" in caplog.text
    groups = assign_groups(tiny_model(0), spec)
    assert [g.name for g in groups] == ["default"]
