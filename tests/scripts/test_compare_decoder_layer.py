#!/usr/bin/env python3
"""The layer comparison's config handling (scripts/compare_decoder_layer.py), without a GPU or torch:
the layer it builds from --model-config, and the errors for configs it cannot compare at.
Usage: test_compare_decoder_layer.py REPO_ROOT"""
import json
import os
import sys
import tempfile
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import compare_decoder_layer as cdl  # noqa: E402  (stdlib imports only at module level)


def write_json(d, obj):
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return path


class ModelLayerConfig(unittest.TestCase):
    def test_the_benchmark_models_widths(self):
        cfg = cdl.model_layer_config(os.path.join(REPO, "examples", "configs", "moe-5b.json"), 4096)
        self.assertEqual((cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]),
                         (2048, 16, 4, 128))
        self.assertEqual((cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]), (64, 8, 768))
        self.assertTrue(cfg["norm_topk_prob"])
        self.assertEqual(cfg["num_hidden_layers"], 1)  # one layer, whatever the model has
        self.assertEqual(cfg["model_type"], "qwen3_moe")
        self.assertGreaterEqual(cfg["max_position_embeddings"], 4096)

    def test_more_tokens_than_the_model_allows_still_fit_the_rotary_table(self):
        with tempfile.TemporaryDirectory() as d:
            small = cdl.layer_config(1)
            small["max_position_embeddings"] = 128
            self.assertEqual(cdl.model_layer_config(write_json(d, small), 1000)["max_position_embeddings"], 1000)

    def test_head_dim_derived_when_absent(self):
        with tempfile.TemporaryDirectory() as d:
            c = cdl.layer_config(1)
            del c["head_dim"]
            c["hidden_size"], c["num_attention_heads"] = 1024, 8
            self.assertEqual(cdl.model_layer_config(write_json(d, c), 16)["head_dim"], 128)

    def test_refusals_name_the_file_and_the_problem(self):
        with tempfile.TemporaryDirectory() as d:
            mixtral = os.path.join(REPO, "examples", "configs", "mixtral-8x7b-v0.1.json")
            with self.assertRaisesRegex(SystemExit, "mixtral-8x7b-v0.1.json: model_type is 'mixtral'"):
                cdl.model_layer_config(mixtral, 16)
            c = cdl.layer_config(1)
            del c["num_experts"]
            path = write_json(d, c)
            with self.assertRaisesRegex(SystemExit, "config.json: field 'num_experts' is missing"):
                cdl.model_layer_config(path, 16)
            with self.assertRaisesRegex(SystemExit, "cannot read it as JSON"):
                cdl.model_layer_config(write_json(d, "{ not json"), 16)
            with self.assertRaisesRegex(SystemExit, "cannot read it as JSON"):
                cdl.model_layer_config(os.path.join(d, "absent.json"), 16)
            with self.assertRaisesRegex(SystemExit, "the top level is a JSON list, not an object"):
                cdl.model_layer_config(write_json(d, "[1, 2]"), 16)
            for field, bad in (("hidden_size", "2048"), ("num_experts", 0), ("num_experts_per_tok", 2.5),
                               ("num_attention_heads", True), ("max_position_embeddings", "long")):
                c = cdl.layer_config(1)
                c[field] = bad
                with self.assertRaisesRegex(SystemExit, f"field '{field}' is {bad!r}"):
                    cdl.model_layer_config(write_json(d, c), 16)


class InitOptions(unittest.TestCase):
    """Which weights the layer is compared at: the one option read by canonical_weights (torch only there)."""

    def parse(self, *argv):
        saved = sys.argv
        sys.argv = ["compare_decoder_layer.py", *argv]
        try:
            return cdl.parse_args()
        finally:
            sys.argv = saved

    def test_default_and_each_choice(self):
        self.assertEqual(self.parse().init, "scaled")
        self.assertEqual(self.parse("--init", "transformers").init, "transformers")
        self.assertEqual(self.parse("--init", "transformers").initializer_range, 0.02)
        self.assertEqual(self.parse("--unscaled-init").init, "unscaled")  # the older spelling

    def test_contradictions_and_bad_ranges_are_refused(self):
        with open(os.devnull, "w") as null:
            saved, sys.stderr = sys.stderr, null
            try:
                for argv in (("--unscaled-init", "--init", "transformers"), ("--init", "transformers", "--initializer-range", "0"),
                             ("--init", "fan-in"), ("--init", "scaled", "--unscaled-init"), ("--initializer-range", "0.01")):
                    with self.assertRaises(SystemExit, msg=argv):
                        self.parse(*argv)
            finally:
                sys.stderr = saved


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
