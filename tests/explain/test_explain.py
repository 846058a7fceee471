import json
import re

import keras
import numpy as np
import pytest

import towers
from tests.models import build_mlp, regression_batch
from towers.explain.graph import stage_of

CPU = [f"/device:CPU:{i}" for i in range(8)]


def make_engine(devices, **kwargs):
    keras.utils.set_random_seed(0)
    return towers.Towers(
        build_mlp,
        "mse",
        lambda: keras.optimizers.Adam(0.1),  # made under the variable device
        devices=devices,
        metrics=["mae"],
        **kwargs,
    )


def model_bytes(engine):
    return sum(int(np.prod(v.shape)) * 4 for v in engine.model.trainable_variables)


def test_explain_reports_central_placement_as_tensorflow_ran_it():
    engine = make_engine(CPU[:2])
    x, y = regression_batch(np.random.default_rng(0), 5)

    report = engine.explain(x, y)

    assert report.sizes == [3, 2]
    model = {(v.path, tuple(v.shape)) for v in engine.model.variables}
    reported = {(v.name, v.shape) for v in report.variables if v.owner == "model"}
    assert reported == model
    slots = [v for v in report.variables if v.owner == "optimizer"]
    assert len(slots) == len(engine.optimizer.variables)
    assert {v.device for v in report.variables} == {CPU[0]}
    assert sum(v.bytes for v in report.variables if v.owner == "model") == (
        model_bytes(engine)
    )
    # Each tower's backward pass ran on its own device; combine and apply once,
    # on the variable device.
    assert report.ran_on("tower 1 backward") == [CPU[1]]
    assert report.ran_on("tower 0 backward") == [CPU[0]]
    assert report.ran_on("combine") == [CPU[0]]
    assert report.ran_on("apply") == [CPU[0]]
    # Tower 1 got its shard (2 examples of x: 6 floats, y: 2 floats) and every
    # weight, and sent back one gradient per weight.
    sent = {(t.source, t.target, t.kind): t.bytes for t in report.transfers}
    assert sent[(CPU[0], CPU[1], "batch")] == 2 * (6 + 2) * 4
    assert sent[(CPU[0], CPU[1], "weights")] == model_bytes(engine)
    assert sent[(CPU[1], CPU[0], "gradients")] == model_bytes(engine)
    assert sent[(CPU[1], CPU[0], "loss")] == 4  # its share of the loss, a float
    assert report.unknown_bytes == 0
    # A weight is read where it lives, for the tower that uses it.
    read = {
        (t.source_stage, t.target_stage)
        for t in report.transfers
        if t.kind == "weights"
    }
    assert read == {("variables", "tower 1 forward")}


def test_explain_follows_the_variable_device_off_the_towers():
    engine = make_engine(CPU[:2], variable_device=CPU[2])
    x, y = regression_batch(np.random.default_rng(0), 6)

    report = engine.explain(x, y)

    on = {v.name: v.device for v in report.variables}
    slots = [v.path for v in engine.optimizer.variables if "_momentum" in v.path]
    assert {on[v.path] for v in engine.model.variables} == {CPU[2]}
    assert {on[path] for path in slots} == {CPU[2]}
    assert on[engine.optimizer.iterations.path] == CPU[2]
    assert report.ran_on("apply") == [CPU[2]]
    assert report.ran_on("combine") == [CPU[2]]
    gradients = {t.source: t.bytes for t in report.transfers if t.kind == "gradients"}
    assert gradients == {CPU[0]: model_bytes(engine), CPU[1]: model_bytes(engine)}


def test_explain_shows_replicated_copies_and_their_all_reduce():
    engine = make_engine(CPU[:2], placement="replicated")
    x, y = regression_batch(np.random.default_rng(0), 4)

    report = engine.explain(x, y)

    kernels = [v.device for v in report.variables if v.name.endswith("kernel")]
    assert sorted(kernels) == [CPU[0], CPU[0], CPU[1], CPU[1]]
    reduced = {t.source: t.bytes for t in report.transfers if t.kind == "all-reduce"}
    assert reduced == {CPU[0]: model_bytes(engine), CPU[1]: model_bytes(engine)}
    assert sorted(report.ran_on("apply")) == CPU[:2]


def test_explain_leaves_the_engine_as_it_found_it():
    x, y = regression_batch(np.random.default_rng(1), 7)
    explained, untouched = make_engine(CPU[:2]), make_engine(CPU[:2])
    for engine in (explained, untouched):
        engine.train_step(x, y)

    explained.explain(x, y)

    state = [
        (a.numpy(), b.numpy())
        for a, b in zip(
            explained.model.variables + explained.optimizer.variables,
            untouched.model.variables + untouched.optimizer.variables,
        )
    ]
    for a, b in state:
        np.testing.assert_array_equal(a, b)
    assert explained.steps_done == untouched.steps_done == 1
    assert explained.metrics[0].result().numpy() == untouched.metrics[0].result()
    # The next step matches too: nothing (slots, counts) moved.
    explained.train_step(x, y)
    untouched.train_step(x, y)
    for a, b in zip(explained.model.variables, untouched.model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_explain_report_text_names_every_variable_and_stage():
    engine = make_engine(CPU[:3])
    x, y = regression_batch(np.random.default_rng(0), 7)

    text = str(engine.explain(x, y))

    for var in engine.model.variables + engine.optimizer.variables:
        assert var.path in text
    for stage in ("split", "tower 2 forward", "tower 2 backward", "combine", "apply"):
        assert f"\n  {stage} " in text
    assert "apply ran on         /device:CPU:0" in text
    assert "shards of [3, 2, 2] examples" in text


def test_explain_png_and_json_round_trip(tmp_path):
    import matplotlib.image

    engine = make_engine(CPU[:2])
    report = engine.explain(*regression_batch(np.random.default_rng(0), 5))

    report.save_png(str(tmp_path / "step.png"))
    image = matplotlib.image.imread(tmp_path / "step.png")
    assert image.shape[0] > 300 and image.shape[1] > 300
    # Something was drawn: boxes are coloured, not just white and grey text.
    colours = {tuple(np.round(px, 2)) for px in image[..., :3].reshape(-1, 3)[::97]}
    assert len(colours) > 10
    data = json.loads(json.dumps(report.to_dict()))
    assert data["sizes"] == [3, 2]
    assert {v["device"] for v in data["variables"]} == {CPU[0]}


def test_explain_refuses_an_empty_batch():
    engine = make_engine(CPU[:2])
    with pytest.raises(ValueError, match="received 0"):
        engine.explain(np.zeros((0, 6), "float32"), np.zeros((0, 2), "float32"))


@pytest.mark.parametrize(
    "name, stage",
    [
        ("tower_3/sequential/dense/MatMul", "tower 3 forward"),
        ("gradient_tape/tower_0/sequential/dense/MatMul", "tower 0 backward"),
        ("ConstantFolding/gradient_tape/tower_2/x/ShapeN", "tower 2 backward"),
        ("combine_2/AddN", "combine"),
        ("all_reduce/CollectiveReduceV2", "combine"),
        ("across_workers/pack", "across workers"),
        ("apply_1/SGD/Mul", "apply"),
        ("split/split", "split"),
        ("Identity_1", "other"),
    ],
)
def test_stage_of_reads_the_engines_name_scopes(name, stage):
    assert stage_of(name) == stage


def test_explaining_again_reads_only_its_own_step_and_collects_nothing_after():
    from tensorflow.python.eager import context

    x, y = regression_batch(np.random.default_rng(3), 9)
    make_engine(CPU[:3]).explain(x, y)  # a larger step, explained first
    report = make_engine(CPU[:2]).explain(x, y)

    # The second report is of its own 2-tower step, not the first one's.
    assert report.sizes == [5, 4]
    assert {s for s in report.ops if s.startswith("tower")} == {
        "tower 0 forward",
        "tower 0 backward",
        "tower 1 forward",
        "tower 1 backward",
    }
    # After explaining, TensorFlow keeps no graphs of the functions that follow.
    make_engine(CPU[:2]).train_step(x, y)
    leftover = context.context().export_run_metadata()
    kept = 0 if leftover is None else len(leftover.function_graphs)
    assert kept == 0


def test_explain_shows_each_towers_phases_under_global_statistics_and_xla():
    """A BatchNormalization model with global statistics and XLA: each tower's
    pass is several XLA computations, the towers' sums between them; the
    report lists them per tower and device, as TensorFlow placed them."""
    from tests.step.rules.test_global_batch_statistics import bn_mlp

    keras.utils.set_random_seed(0)
    engine = towers.Towers(
        bn_mlp,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=CPU[:2],
        batch_statistics="global",
        jit_compile=True,
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 5)).astype("float32"), rng.normal(size=(7, 1))

    report = engine.explain(x, y)

    for t in range(2):
        mine = [c for c in report.xla if c.stage == f"tower {t} XLA"]
        assert len(mine) == 7  # 2 BatchNormalization layers: 3 sums each, 7 phases
        assert {c.device for c in mine} == {f"/device:CPU:{t}"}
        line = f"{f'tower {t} XLA':<18} on /device:CPU:{t}: 7 phases, the towers' sums"
        assert line in str(report)


def test_explain_names_each_coupled_loss_term_and_how_it_is_computed():
    from tests.step.rules.test_coupled import mixtral_block

    keras.utils.set_random_seed(0)
    engine = towers.Towers(mixtral_block, "mse", "sgd", devices=CPU[:2])
    batch = {"token_ids": np.ones((3, 4), "int32"), "padding_mask": np.ones((3, 4))}

    text = str(engine.explain(batch, np.zeros((3, 4, 16), "float32")))

    lines = text.split("loss terms that couple the batch's examples:\n")[1]
    assert re.match(
        r"  layer transformer_layer_0/mixtral_sparse_moe_block(_\d+)? "
        r"\(MixtralSparseMoeBlock\) adds a router load-balancing loss "
        r"\(router_aux_loss_coef=0.02\): f_e and P_e from the whole batch",
        lines,
    )
    plain = make_engine(CPU[:2]).explain(*regression_batch(np.random.default_rng(0), 4))
    assert "loss terms that couple" not in str(plain)


def test_explain_probes_loss_terms_as_the_first_step_does():
    from tests.step.rules.test_probe import contrastive, data

    x, y = data()
    refused = towers.Towers(contrastive(), devices=CPU[:2], coupled_losses="refuse")
    with pytest.raises(ValueError, match=r"Contrastive.compute_loss is .*apart"):
        refused.explain(x, y)

    gathered = towers.Towers(contrastive(), devices=CPU[:2])
    lines = str(gathered.explain(x, y)).split("couple the batch's examples:\n")[1]
    assert re.match(r"  Contrastive.compute_loss is .* apart\): on the whole", lines)

    with pytest.warns(UserWarning, match="Contrastive.compute_loss"):
        engine = towers.Towers(
            contrastive(), devices=CPU[:2], coupled_losses="per_tower"
        )
        text = str(engine.explain(x, y))
    lines = text.split("loss terms that couple the batch's examples:\n")[1]
    assert re.match(r"  Contrastive.compute_loss is .* apart\): per tower", lines)
