"""Offline target features (trainer.features): stored layers equal the online ones, a training step from the cache
equals the online step, the baseline from the cache runs no target forward, an interrupted extraction resumes, and a
stale or foreign cache is refused. Real tiny targets, real files, the real Trainer."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, greedy_dataset, make_drafter, make_target
from transformers import TrainingArguments

import trainer.features as features_module
from modeling_carryover.modeling_carryover import hidden_state_request, layer_outputs
from trainer.carryover_trainer import AblationArguments, CarryoverArguments, CarryoverTrainer, pad_collator
from trainer.build import FEATURE_INDEX, load_training_rows
from trainer.features import FEATURES_MANIFEST, TargetFeatures, extract_features, rows_with_features
from trainer.objectives import LossSettings, training_step_loss
from trainer.run import main as run_main
from trainer.verification import target_pass

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def setup():
    """A tiny target, its greedy rows, a Markov drafter, and fp32 and bf16 caches of the drafter's layers + the last."""
    target = make_target("llama")
    rows = greedy_dataset(target, num_rows=10, new_tokens=20)
    drafter = make_drafter(target, markov_rank=8)
    layer_ids = drafter.config.target_layer_ids + [target.config.num_hidden_layers - 1]
    return target, rows, drafter, layer_ids


def extract(setup, path, dtype=torch.float32, **kwargs):
    target, rows, _, layer_ids = setup
    settings = dict(dtype=dtype, max_seq_length=MAX_LENGTH, shard_size=4, batch_size=3, progress=False) | kwargs
    return extract_features(target, rows, path, layer_ids, **settings)


def collated(features, rows, indices):
    return pad_collator([rows[i] for i in indices], features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_features_equal_online_ones(setup, tmp_path, dtype):
    """The collated stored layers equal the target's forward over the same training batch: exactly in fp32, and the
    online layers rounded to bf16 for a bf16 cache (rows stored from batches of other rows and lengths)."""
    target, rows, drafter, layer_ids = setup
    features = extract(setup, tmp_path / "features", dtype)
    attached = features.attach(rows, MAX_LENGTH)
    assert features.layer_ids == sorted(set(layer_ids)) and len(features) == len(rows)
    num_layers = target.config.num_hidden_layers
    for indices in ([0, 5, 9, 2], [7]):
        batch = collated(features, attached, indices)
        online = target_pass(target, batch["input_ids"], batch["attention_mask"], hidden_state_request(layer_ids))
        cached = batch["target_hidden_states"]
        mask = batch["attention_mask"].bool()
        for layer in range(num_layers):
            if layer not in layer_ids:
                assert cached[layer] is None
                continue
            assert cached[layer].dtype == dtype
            expected = layer_outputs(online.hidden_states, [layer], num_layers)[0].to(dtype)  # any transformers' format
            torch.testing.assert_close(cached[layer][mask], expected[mask], atol=0, rtol=0)
            assert not cached[layer][~mask].any()  # padding stays zero
        torch.testing.assert_close(
            drafter.target_features(cached)[mask], drafter.target_features(online.hidden_states)[mask].to(dtype), atol=0, rtol=0
        )


def step(drafter, target, batch, carryover):
    torch.manual_seed(0)  # the same anchors
    drafter.zero_grad()
    loss, metrics = training_step_loss(drafter, target, batch, 8, LossSettings(gamma=4.0), carryover=carryover)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("carryover", [False, True])
@pytest.mark.parametrize("markov_rank", [0, 8])
def test_training_step_from_the_cache_equals_the_online_step(setup, tmp_path, carryover, markov_rank):
    target, rows, _, _ = setup
    features = extract(setup, tmp_path / "features")
    attached = features.attach(rows, MAX_LENGTH)
    drafter = make_drafter(target, markov_rank=markov_rank).train()
    drafter.carry_embedding.data.normal_()  # carried rows make a difference to the loss
    batch = collated(features, attached, [1, 3, 8, 6])
    cached = step(drafter, target, batch, carryover)
    online = step(drafter, target, {k: v for k, v in batch.items() if k != "target_hidden_states"}, carryover)
    torch.testing.assert_close(cached[0], online[0], atol=0, rtol=0)
    assert cached[1].keys() == online[1].keys()
    for name in cached[1]:
        torch.testing.assert_close(cached[1][name], online[1][name], atol=0, rtol=0, msg=name)
    assert cached[2].keys() == online[2].keys() and len(cached[2]) > 0
    for name, grad in cached[2].items():
        torch.testing.assert_close(grad, online[2][name], atol=0, rtol=0, msg=name)


def count_target_forwards(target):
    calls = []
    target.model.register_forward_hook(lambda *_: calls.append(1))  # the decoder: embeddings and LM head are not it
    return calls


def train(target, rows, drafter, features, carryover, output_dir, steps=3):
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=steps, learning_rate=3e-3,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no", logging_steps=100,
    )
    trainer = CarryoverTrainer(
        model=drafter.train(), args=args, train_dataset=rows, target_model=target, target_features=features,
        carryover_args=CarryoverArguments(num_anchors=8, carryover=carryover),
        ablation_args=AblationArguments(carry_embedding_init="feature_rms"),
    )
    trainer.train()
    return drafter


@pytest.mark.parametrize("carryover", [False, True])
def test_trainer_from_the_cache_trains_as_online_and_the_baseline_runs_no_target_forward(setup, tmp_path, carryover):
    """A few real Trainer steps read from an fp32 cache end with the same weights as online training; the baseline
    never calls the target's decoder, carryover calls it only to verify (and for the K/V cache)."""
    _, rows, _, _ = setup
    target = make_target("llama")  # its own copy: the hook stays on it
    features = extract((target, *setup[1:]), tmp_path / "features")
    attached = features.attach(rows, MAX_LENGTH)
    online = train(target, attached, make_drafter(target, markov_rank=8), None, carryover, tmp_path / "online")
    calls = count_target_forwards(target)
    cached = train(target, attached, make_drafter(target, markov_rank=8), features, carryover, tmp_path / "cached")
    assert (len(calls) > 0) == carryover
    for (name, a), b in zip(online.state_dict().items(), cached.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_interrupted_extraction_resumes_without_redoing_a_shard(setup, tmp_path, monkeypatch):
    straight = extract(setup, tmp_path / "straight")
    shard_features, calls, stop_at = features_module._shard_features, [], [2]

    def interrupted(*args):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return shard_features(*args)

    monkeypatch.setattr(features_module, "_shard_features", interrupted)
    with pytest.raises(KeyboardInterrupt):
        extract(setup, tmp_path / "resumed")
    first = tmp_path / "resumed" / "features-00000.safetensors"
    assert first.exists() and not (tmp_path / "resumed" / "features-00001.safetensors").exists()
    assert not list((tmp_path / "resumed").glob("*.tmp"))
    with pytest.raises(ValueError, match="1 of 3 feature shards are missing|2 of 3 feature shards are missing"):
        TargetFeatures(tmp_path / "resumed")
    written = first.stat().st_mtime_ns
    calls.clear()
    stop_at[0] = None
    resumed = extract(setup, tmp_path / "resumed", batch_size=5)  # the batch size may change
    assert len(calls) == 2 and first.stat().st_mtime_ns == written  # shards 1 and 2 only
    for i in range(len(straight)):
        assert torch.equal(straight.row(i), resumed.row(i))


def test_features_of_grown_rows_grow_the_folder(setup, tmp_path, monkeypatch):
    """Rows that extend the stored ones (a regeneration grown since) add feature shards for the new rows only (and the
    partial last shard again); the grown folder equals one extracted straight, and still serves the old rows."""
    target, rows, drafter, layer_ids = setup
    straight = extract(setup, tmp_path / "straight")
    extract((target, rows.select(range(8)), drafter, layer_ids), tmp_path / "grown")  # 2 shards of 4
    first = tmp_path / "grown" / "features-00000.safetensors"
    written, calls = first.stat().st_mtime_ns, []
    shard_features = features_module._shard_features
    monkeypatch.setattr(features_module, "_shard_features", lambda *args: calls.append(1) or shard_features(*args))
    grown = extract(setup, tmp_path / "grown")
    assert len(calls) == 1 and first.stat().st_mtime_ns == written  # the third shard (rows 8-9) only
    assert len(grown) == 10 and grown.manifest == TargetFeatures(tmp_path / "straight").manifest
    for i in range(len(straight)):
        assert torch.equal(straight.row(i), grown.row(i))
    assert grown.attach(rows.select(range(8)), MAX_LENGTH)[FEATURE_INDEX] == list(range(8))
    # a partial last shard is extracted again with the new rows
    extract((target, rows.select(range(6)), drafter, layer_ids), tmp_path / "part")  # rows 4-5 in the second shard
    first, calls[:] = tmp_path / "part" / "features-00000.safetensors", []
    written = first.stat().st_mtime_ns
    grown = extract(setup, tmp_path / "part")
    assert len(calls) == 2 and first.stat().st_mtime_ns == written  # the second and third shards
    assert all(torch.equal(straight.row(i), grown.row(i)) for i in range(len(straight)))
    # rows that do not extend the stored ones are refused
    for other in (range(2, 10), range(1, 7)):  # whole shards / a partial one, of other rows
        extract((target, rows.select(other), drafter, layer_ids), tmp_path / f"other-{len(other)}")
        with pytest.raises(ValueError, match="different data_fingerprint, num_rows"):
            extract(setup, tmp_path / f"other-{len(other)}")


def test_one_features_folder_per_dataset_reads_as_one(setup, tmp_path):
    """`--features` with one folder per dataset: the rows of both, in order, read the same features as one folder
    extracted over all of them; mismatched folders are refused; run.py trains from them."""
    target, rows, drafter, layer_ids = setup
    one = extract(setup, tmp_path / "one")
    datasets, folders = [str(tmp_path / "a"), str(tmp_path / "b")], [str(tmp_path / "fa"), str(tmp_path / "fb")]
    for part, dataset, folder in zip((range(7), range(7, 10)), datasets, folders):
        rows.select(part).save_to_disk(dataset)
        extract((target, rows.select(part), drafter, layer_ids), folder)
    attached, per_dataset = rows_with_features(datasets, None, folders, MAX_LENGTH)
    assert attached["input_ids"] == rows["input_ids"] and attached[FEATURE_INDEX] == list(range(10))
    assert len(per_dataset) == 10
    indices = [5, 6, 7, 9]  # across both folders
    lengths = [len(attached[i]["input_ids"]) for i in indices]
    for mine, straight in zip(per_dataset.hidden_states(indices, lengths, 40), one.hidden_states(indices, lengths, 40)):
        assert (mine is None and straight is None) or torch.equal(mine, straight)
    with pytest.raises(ValueError, match="3 features folders for 2 datasets"):
        rows_with_features(datasets, None, [*folders, folders[0]], MAX_LENGTH)
    with pytest.raises(ValueError, match="fb holds features of other rows"):
        rows_with_features(datasets, None, folders[::-1], MAX_LENGTH)
    extract((target, rows.select(range(7, 10)), drafter, layer_ids[:1]), tmp_path / "fewer")
    with pytest.raises(ValueError, match="fewer and .*fa hold features of different layer_ids"):
        rows_with_features(datasets, None, [folders[0], str(tmp_path / "fewer")], MAX_LENGTH)
    bf16_target = make_target("llama").to(torch.bfloat16)  # its weights' bf16 fingerprint is the float32 target's
    extract((bf16_target, rows.select(range(7, 10)), drafter, layer_ids), tmp_path / "bf16-target")
    with pytest.raises(ValueError, match="bf16-target and .*fa hold features of different target_dtype"):
        rows_with_features(datasets, None, [folders[0], str(tmp_path / "bf16-target")], MAX_LENGTH)
    target.save_pretrained(tmp_path / "target")
    trained = run_main(
        ["--target", str(tmp_path / "target"), "--dataset", *datasets, "--features", *folders, "--num_draft_layers",
         "2", "--block_size", "4", "--num_anchors", "8", "--per_device_train_batch_size", "5", "--max_steps", "2",
         "--max_seq_length", str(MAX_LENGTH), "--report_to", "none", "--use_cpu", "--save_strategy", "no",
         "--disable_tqdm", "true", "--output_dir",
         str(tmp_path / "out")]
    )
    assert trained.state.global_step == 2


def test_a_stale_or_foreign_cache_is_refused(setup, tmp_path):
    target, rows, drafter, layer_ids = setup
    features = extract(setup, tmp_path / "features", torch.bfloat16)
    with pytest.raises(ValueError, match="another target"):
        features.check_target(make_target("llama", seed=1))
    with pytest.raises(ValueError, match=r"other layers.*missing \[1\]"):
        features.check_layers([1, *layer_ids])
    with pytest.raises(ValueError, match="other rows"):
        features.attach(rows.select(range(9)), MAX_LENGTH)
    # a prefix of whole feature shards is the first rows of the cache (--dataset_shards); other 8 rows are not
    assert features.attach(rows.select(range(8)), MAX_LENGTH)[FEATURE_INDEX] == list(range(8))
    with pytest.raises(ValueError, match="other rows"):
        features.attach(rows.select(range(1, 9)), MAX_LENGTH)
    with pytest.raises(ValueError, match="shorter rows"):
        features.attach(rows, MAX_LENGTH + 1)
    with pytest.raises(ValueError, match="different dtype"):  # resuming with other settings
        extract(setup, tmp_path / "features", torch.float16)
    with pytest.raises(ValueError, match="different data_fingerprint, num_rows"):
        extract((target, rows.select(range(9)), drafter, layer_ids), tmp_path / "features", torch.bfloat16)
    # layers the target lacks, or no rows: refused before anything is written
    with pytest.raises(ValueError, match=r"target_layer_ids \[10\] out of range: the target has 4 decoder layers"):
        extract((target, rows, drafter, [1, 10]), tmp_path / "bad-layers")
    with pytest.raises(ValueError, match="the dataset is empty"):
        extract((target, rows.select([]), drafter, layer_ids), tmp_path / "no-rows")
    assert not (tmp_path / "bad-layers").exists() and not (tmp_path / "no-rows").exists()
    # the Trainer refuses a drafter needing a layer that is not stored, and rows without their feature index
    dflash = make_drafter(target, target_layer_ids=[0, 1])
    with pytest.raises(ValueError, match="other layers"):
        train(target, features.attach(rows, MAX_LENGTH), dflash, features, False, tmp_path / "out")
    with pytest.raises(ValueError, match="no 'feature_index' column"):
        train(target, rows, make_drafter(target), features, False, tmp_path / "out")
    assert (tmp_path / "features" / FEATURES_MANIFEST).exists()


def test_cli_extracts_features_and_run_trains_from_them(setup, tmp_path):
    """`python -m trainer.features`, then `trainer/run.py --features` (baseline, then carryover continuing it), on a
    mix given as two datasets (separately made sources: their rows in order)."""
    target, rows, _, _ = setup
    target.save_pretrained(tmp_path / "target")
    rows.select(range(6)).save_to_disk(str(tmp_path / "data"))
    rows.select(range(6, 10)).add_column("source", ["b"] * 4).save_to_disk(str(tmp_path / "more"))
    datasets = [str(tmp_path / "data"), str(tmp_path / "more")]
    mixed = load_training_rows(datasets)
    assert mixed.column_names == rows.column_names and mixed["input_ids"] == rows["input_ids"]  # shared columns only
    with pytest.raises(ValueError, match="1 shard counts for 2 datasets: give one count per dataset"):
        load_training_rows(datasets, num_shards=1)
    with pytest.raises(ValueError, match="more is not a regenerated folder: it has no shards"):
        load_training_rows(datasets, num_shards=[0, 1])
    result = subprocess.run(
        [sys.executable, "-m", "trainer.features", "--dataset", *datasets, "--output_dir",
         str(tmp_path / "features"), "--target", str(tmp_path / "target"), "--num_draft_layers", "2",
         "--dtype", "bfloat16", "--shard_size", "4", "--threads", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "10 rows" in result.stdout
    common = ["--target", str(tmp_path / "target"), "--dataset", *datasets, "--features",
              str(tmp_path / "features"), "--num_anchors", "8", "--per_device_train_batch_size", "4", "--max_steps", "2",
              "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--disable_tqdm", "true"]
    baseline = run_main([*common, "--output_dir", str(tmp_path / "baseline"), "--num_draft_layers", "2", "--block_size", "4"])
    assert baseline.state.global_step == 2 and (tmp_path / "baseline" / "model.safetensors").exists()
    carryover = run_main([*common, "--output_dir", str(tmp_path / "carryover"), "--carryover",
                          "--drafter_checkpoint", str(tmp_path / "baseline")])
    assert carryover.state.global_step == 2
    with pytest.raises(ValueError, match=r"other layers.*missing \[1\]"):  # stored: DFlash's [0, 3] for 2 layers
        run_main([*common, "--output_dir", str(tmp_path / "other"), "--num_draft_layers", "2", "--target_layer_ids", "1", "3"])
