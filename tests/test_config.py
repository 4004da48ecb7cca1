"""Config loading, validation and reload."""

import copy
import dataclasses
import os
import tomllib
from pathlib import Path

import pytest

from gateway.config.sections import Config, Instance, Weights, parse_config
from gateway.config.store import ConfigStore, default_config_path, load_config
from gateway.config_schema import ConfigError
from gateway.core.engine.profiles import spec_for_instance

REPO = Path(__file__).resolve().parent.parent


def default_data() -> dict:
    with open(default_config_path(), "rb") as fh:
        return tomllib.load(fh)


def minimal_instance(name="a", port=9001, **extra) -> dict:
    return {
        "name": name,
        "url": f"http://127.0.0.1:{port}",
        "model": "m",
        "gpu": "A30-24GB",
        "price_input_per_mtok": 0.1,
        "price_output_per_mtok": 0.2,
        "tpot_prior_ms": 10.0,
        **extra,
    }


def error_of(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.toml")
    return info.value


# --- the default file ------------------------------------------------------


def test_default_config_is_the_paper_pool():
    cfg = load_config(default_config_path())
    assert len(cfg.instances) == 13
    assert cfg.models() == (
        "Qwen/Qwen2.5-72B-Instruct",
        "Qwen/Qwen2.5-14B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-3B-Instruct",
    )
    counts = {m: sum(i.model == m for i in cfg.instances) for m in cfg.models()}
    assert list(counts.values()) == [2, 3, 5, 3]
    assert [i.url for i in cfg.instances] == [f"http://127.0.0.1:{p}" for p in range(8101, 8114)]
    big = cfg.instance("qwen72b-a100-1")
    assert (big.gpu, big.gpu_count, big.tensor_parallel) == ("A100-80GB", 4, 4)
    assert (big.price_input_per_mtok, big.price_output_per_mtok, big.tpot_prior_ms) == (0.38, 0.40, 47.4)
    assert big.gpu_memory_utilization == 0.95
    assert cfg.instance("qwen14b-v100-2").tpot_prior_ms == 18.4
    assert cfg.instance("qwen7b-a30-4").price_output_per_mtok == 0.07
    assert cfg.instance("qwen3b-a30-0").tpot_prior_ms == 12.3
    assert sum(i.gpu_count for i in cfg.instances) == 28
    assert {i.max_model_len for i in cfg.instances} == {8192}
    assert cfg.server.port == 8000 and cfg.server.host == "127.0.0.1"


def test_top_level_config_toml_is_a_relative_symlink_to_the_default():
    link = REPO / "config.toml"
    assert link.is_symlink()
    assert os.readlink(link) == "gateway/config/default.toml"
    assert load_config(link) == load_config(default_config_path())


def test_default_file_spells_out_the_code_defaults():
    # Sections left out of a file must equal what the default file writes out,
    # so the documentation in the file cannot drift from the code.
    written = load_config(default_config_path())
    implied = parse_config({"instances": [minimal_instance()]})
    for section in ("server", "upstream", "scheduler", "batching", "telemetry"):
        assert getattr(written, section) == getattr(implied, section), section
    from gateway.lab.emulator.settings import emulator_of

    assert emulator_of(written) == emulator_of(implied)  # the emulator's table, read by the lab
    assert set(written.policies) == {"routebalance", "pipeline", "avengers", "best_route", "swap_aware_fcfs", "qlm",
                                     "edf", "qos", "qos_rl", "eldr"}
    for table in written.policies:
        assert written.options(table) == implied.options(table), table


def test_policy_tables_are_checked_by_their_policy_and_moved_keys_say_where():
    data = default_data()
    data["policies"]["routebalance"]["latency_term"] = "fast"
    err = error_of(data)
    assert err.key == "policies.routebalance.latency_term" and "'heads'" in err.reason
    data = default_data()
    data["policies"]["pipeline"]["best_route_threshold"] = -1
    assert error_of(data).key == "policies.pipeline.best_route_threshold"
    data = default_data()
    data["policies"]["nobody"] = {"x": 1}
    err = error_of(data)
    assert err.key == "policies.nobody" and "routebalance" in err.reason and "pipeline" in err.reason
    data = default_data()
    data["scheduler"]["lpt"] = False  # where it lived before the registry
    err = error_of(data)
    assert err.key == "scheduler.lpt" and "[policies.routebalance]" in err.reason
    cfg = load_config(default_config_path())
    changed = cfg.with_options("routebalance", lpt=False)
    assert not changed.options("routebalance").lpt and cfg.options("routebalance").lpt
    assert changed.options("pipeline") == cfg.options("pipeline")


def test_presets_are_normalised_and_helpers_work():
    cfg = load_config(default_config_path())
    uniform = cfg.weights("uniform")
    assert uniform.quality == pytest.approx(1 / 3)
    assert uniform.quality + uniform.latency + uniform.cost == pytest.approx(1.0)
    assert cfg.weights("quality") == Weights(quality=0.8, latency=0.1, cost=0.1)
    assert Weights(quality=2, cost=2).cost == pytest.approx(0.5)
    with pytest.raises(KeyError):
        cfg.instance("nope")
    with pytest.raises(KeyError):
        cfg.weights("nope")


def test_user_presets_add_to_the_builtin_ones():
    data = {"scheduler": {"preset": "mine", "presets": {"mine": {"quality": 1}}},
            "instances": [minimal_instance()]}
    cfg = parse_config(data)
    assert cfg.weights("mine") == Weights(quality=1.0, latency=0.0, cost=0.0)
    assert set(cfg.scheduler.presets) >= {"quality", "uniform", "cost", "latency", "mine"}


def test_config_is_immutable():
    cfg = load_config(default_config_path())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.scheduler.presets["x"] = Weights(quality=1)  # type: ignore[index]


def test_optional_fields_and_inference():
    inst = parse_config({"instances": [minimal_instance(url="http://h:1/")]}).instances[0]
    assert inst.url == "http://h:1"  # trailing slash dropped, so callers append paths
    assert inst.gpu_memory_gb == 24.0  # read from "A30-24GB"
    assert dict(inst.faults) == {}  # the emulator's table, not read by the serving side
    from gateway.lab.emulator.settings import faults_of

    assert faults_of(parse_config({"instances": [minimal_instance()]}), 0).down is False
    cfg = parse_config({"server": {"admin_token": "s3cret"}, "instances": [minimal_instance()]})
    assert cfg.server.admin_token == "s3cret"
    assert parse_config({"instances": [minimal_instance()]}).server.admin_token is None


def test_int_is_accepted_where_float_is_wanted():
    cfg = parse_config({"upstream": {"read_timeout_s": 5}, "instances": [minimal_instance()]})
    assert cfg.upstream.read_timeout_s == 5.0 and isinstance(cfg.upstream.read_timeout_s, float)


# --- validation errors name the key ---------------------------------------


def test_unknown_key_at_top_level():
    data = default_data()
    data["sever"] = {"port": 1}
    err = error_of(data)
    assert err.key == "sever"
    assert str(err) == "test.toml: sever: unknown key"


def test_unknown_key_nested():
    data = default_data()
    data["instances"][3]["pricee_input"] = 0.1
    err = error_of(data)
    assert err.key == "instances[3].pricee_input"
    assert "instances[3].pricee_input: unknown key" in str(err)

    # The emulator's tables are checked by `emulate` and `up` (the serving side keeps them unread).
    from gateway.lab.emulator.settings import checked

    data = default_data()
    data["instances"][0]["faults"]["eror_rate"] = 0.1
    with pytest.raises(ConfigError) as e:
        checked(parse_config(data, "test.toml"))
    assert e.value.key == "instances[0].faults.eror_rate"
    for bad in (-1, float("nan")):
        data = default_data()
        data["emulator"]["tick_s"] = bad
        with pytest.raises(ConfigError) as e:
            checked(parse_config(data, "test.toml"))
        assert e.value.key == "emulator.tick_s"

    data = default_data()
    data["scheduler"]["presets"]["cost"]["qualty"] = 1
    assert error_of(data).key == "scheduler.presets.cost.qualty"


def test_wrong_type():
    data = default_data()
    data["server"]["port"] = "8000"
    assert "server.port: expected int, got str" in str(error_of(data))

    data = default_data()
    data["server"] = 5
    assert "server: expected table, got int" in str(error_of(data))

    data = default_data()
    data["batching"]["rules"] = {"below": 1}
    assert "batching.rules: expected array, got table" in str(error_of(data))

    data = default_data()
    data["scheduler"]["policy"] = "fastest"
    err = error_of(data)
    assert err.key == "scheduler.policy" and "routebalance, passthrough+round_robin" in err.reason

    data = default_data()
    data["upstream"]["retries"] = 1.0  # a float is not an int
    assert error_of(data).key == "upstream.retries"


def test_bool_is_not_an_int_or_float():
    data = default_data()
    data["server"]["port"] = True
    assert "server.port: expected int, got bool" in str(error_of(data))

    data = default_data()
    data["instances"][1]["tpot_prior_ms"] = True
    assert "instances[1].tpot_prior_ms: expected float, got bool" in str(error_of(data))


def test_negative_price():
    data = default_data()
    data["instances"][2]["price_output_per_mtok"] = -0.01
    err = error_of(data)
    assert err.key == "instances[2].price_output_per_mtok"
    assert ">= 0" in err.reason


@pytest.mark.parametrize("key,value,path", [
    ("tpot_prior_ms", 0, "instances[0].tpot_prior_ms"),
    ("gpu_memory_utilization", 1.5, "instances[0].gpu_memory_utilization"),
    ("max_num_seqs", 0, "instances[0].max_num_seqs"),
    ("name", "", "instances[0].name"),
])
def test_out_of_range_instance_values(key, value, path):
    data = default_data()
    data["instances"][0][key] = value
    assert error_of(data).key == path


@pytest.mark.parametrize("section,key,value", [
    ("server", "port", 0),
    ("server", "port", 65536),
    ("upstream", "connect_timeout_s", 0.0),
    ("upstream", "retries", -1),
    ("telemetry", "stale_after_s", 0.5),  # not above scrape_interval_s
    ("server", "shutdown_timeout_s", 0.0),
])
def test_out_of_range_section_values(section, key, value):
    data = default_data()
    data[section][key] = value
    assert error_of(data).key == f"{section}.{key}"


def test_negative_or_zero_weights():
    data = default_data()
    data["scheduler"]["presets"]["cost"]["latency"] = -0.1
    assert error_of(data).key == "scheduler.presets.cost.latency"

    data = default_data()
    data["scheduler"]["presets"]["cost"] = {"quality": 0, "latency": 0, "cost": 0}
    err = error_of(data)
    assert err.key == "scheduler.presets.cost" and "all be zero" in err.reason


def test_duplicate_instance_name():
    data = default_data()
    data["instances"][7]["name"] = "qwen7b-a30-1"
    err = error_of(data)
    assert "instances[7].name: duplicate instance name 'qwen7b-a30-1'" in str(err)
    assert "instances[6]" in err.reason  # where the first one is


def test_duplicate_url():
    data = default_data()
    data["instances"][7]["url"] = data["instances"][2]["url"]
    err = error_of(data)
    assert err.key == "instances[7].url" and "instances[2]" in err.reason


def test_instances_sharing_a_gpu_must_name_the_same_gpu():
    data = {"instances": [minimal_instance("a", 9001, gpu_id="g0"),
                          minimal_instance("b", 9002, gpu_id="g0", model="n")]}
    cfg = parse_config(data, "test.toml")
    assert [i.gpu_id for i in cfg.instances] == ["g0", "g0"]
    data["instances"][1]["gpu"] = "A100-80GB"
    err = error_of(data)
    assert err.key == "instances[1].gpu_id" and "'a'" in err.reason
    data["instances"][1]["gpu_id"] = ""
    assert error_of(data).key == "instances[1].gpu_id"


@pytest.mark.parametrize("key", ["name", "url", "model", "gpu", "price_input_per_mtok",
                                 "price_output_per_mtok", "tpot_prior_ms"])
def test_missing_required_key(key):
    data = default_data()
    del data["instances"][5][key]
    assert str(error_of(data)) == f"test.toml: instances[5].{key}: missing required key"


def test_missing_or_empty_instances():
    data = default_data()
    del data["instances"]
    assert error_of(data).key == "instances"
    data["instances"] = []
    err = error_of(data)
    assert err.key == "instances" and "at least one" in err.reason


def test_gpu_memory_is_optional_for_a_real_instance_and_needed_to_emulate_it():
    unknown = parse_config({"instances": [minimal_instance(gpu="H100")]}).instances[0]
    assert unknown.gpu_memory_gb is None
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        spec_for_instance(unknown)
    given = parse_config({"instances": [minimal_instance(gpu="H100", gpu_memory_gb=80)]}).instances[0]
    assert spec_for_instance(given).num_gpu_blocks > 0


def test_tensor_parallel_above_gpu_count():
    data = default_data()
    data["instances"][0]["tensor_parallel"] = 8
    err = error_of(data)
    assert err.key == "instances[0].tensor_parallel" and "gpu_count" in err.reason


def test_unknown_preset():
    data = default_data()
    data["scheduler"]["preset"] = "cheapest"
    err = error_of(data)
    assert err.key == "scheduler.preset" and "'cheapest'" in err.reason


def test_preset_policies_name_known_presets_and_policies():
    data = default_data()
    data["scheduler"]["preset_policies"] = {"latency": "qlm"}
    cfg = parse_config(data, "test.toml")
    assert cfg.scheduler.policy_for("latency") == "qlm" and cfg.scheduler.policy_for("uniform") == "routebalance"
    data["scheduler"]["preset_policies"] = {"fastest": "qlm"}
    err = error_of(data)
    assert err.key == "scheduler.preset_policies.fastest" and "'fastest'" in err.reason
    data["scheduler"]["preset_policies"] = {"latency": "qlmm"}
    err = error_of(data)
    assert err.key == "scheduler.preset_policies.latency" and "'qlmm'" in err.reason


@pytest.mark.parametrize("url", ["127.0.0.1:8101", "ftp://h:1", "http://", "http://h:1/v1"])
def test_bad_url(url):
    data = default_data()
    data["instances"][9]["url"] = url
    assert error_of(data).key == "instances[9].url"


def test_batching_rules_must_be_sorted_and_cover_full_load():
    data = default_data()
    data["batching"]["rules"][1]["below"] = 0.2
    assert error_of(data).key == "batching.rules[1].below"

    data = default_data()
    data["batching"]["rules"][0]["size"] = 0
    assert error_of(data).key == "batching.rules[0].size"

    data = default_data()
    data["batching"]["rules"][2]["below"] = 1.0
    assert error_of(data).key == "batching.rules[2].below"


def test_alias_may_not_shadow_a_model():
    data = default_data()
    data["server"]["aliases"] = ["auto", "Qwen/Qwen2.5-7B-Instruct"]
    assert error_of(data).key == "server.aliases[1]"


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError) as info:
        Weights(quality=-1, cost=1)
    assert info.value.key == "quality"
    with pytest.raises(ConfigError):
        Instance(name="a", url="h:1", model="m", gpu="A30-24GB", price_input_per_mtok=0,
                 price_output_per_mtok=0, tpot_prior_ms=1)


def test_load_config_reports_file_problems(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(bad)
    assert str(bad) in str(info.value)


# --- ConfigStore -----------------------------------------------------------


def write_toml(path: Path, port: int, n_instances: int = 1) -> None:
    lines = [f"[server]\nport = {port}\n"]
    for i in range(n_instances):
        lines.append(
            f'[[instances]]\nname = "i{i}"\nurl = "http://127.0.0.1:{9000 + i}"\n'
            'model = "m"\ngpu = "A30-24GB"\nprice_input_per_mtok = 0.1\n'
            "price_output_per_mtok = 0.1\ntpot_prior_ms = 10.0\n")
    path.write_text("\n".join(lines))


def bump_mtime(path: Path) -> None:
    # Make the rewrite visible even on filesystems with coarse mtimes.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "config.toml"
    write_toml(path, port=8001)
    return ConfigStore(path)


def test_store_loads_and_rejects_a_bad_initial_file(tmp_path, store):
    assert store.current.server.port == 8001
    assert (store.reloads_ok, store.reloads_failed, store.last_error) == (0, 0, None)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 0\n")
    with pytest.raises(ConfigError):
        ConfigStore(bad)


def test_reload_swaps_and_notifies(store):
    seen: list[Config] = []
    store.subscribe(seen.append)
    old = store.current
    write_toml(store.path, port=8002, n_instances=3)
    bump_mtime(store.path)
    ok, message = store.reload()
    assert ok, message
    assert store.current is not old
    assert store.current.server.port == 8002 and len(store.current.instances) == 3
    assert seen == [store.current] and seen[0] is store.current
    assert store.reloads_ok == 1 and store.reloads_failed == 0


def test_reload_of_an_unchanged_file_keeps_the_object_and_notifies_nobody(store):
    seen: list[Config] = []
    store.subscribe(seen.append)
    old = store.current
    ok, _ = store.reload()
    assert ok and store.current is old and seen == [] and store.reloads_ok == 1


def test_unsubscribe(store):
    seen: list[Config] = []
    unsubscribe = store.subscribe(seen.append)
    unsubscribe()
    write_toml(store.path, port=8003)
    assert store.reload()[0]
    assert seen == []


def test_failing_subscriber_does_not_stop_the_swap_or_others(store):
    seen: list[Config] = []

    def broken(cfg):
        raise RuntimeError("boom")

    store.subscribe(broken)
    store.subscribe(seen.append)
    write_toml(store.path, port=8004)
    assert store.reload()[0]
    assert store.current.server.port == 8004 and seen == [store.current]


@pytest.mark.parametrize("content,expected", [
    ("[server]\nport = \n", "invalid TOML"),                   # syntax error
    ("[server]\nport = 70000\n[[instances]]\n", "server.port"),  # schema error
])
def test_bad_reload_keeps_the_old_config(store, content, expected):
    seen: list[Config] = []
    store.subscribe(seen.append)
    old = store.current
    store.path.write_text(content)
    ok, message = store.reload()
    assert not ok and expected in message
    assert store.current is old
    assert store.reloads_failed == 1 and store.reloads_ok == 0
    assert store.last_error is not None and expected in store.last_error
    assert seen == []
    # A later good reload recovers and clears the error.
    write_toml(store.path, port=8005)
    bump_mtime(store.path)
    assert store.reload()[0]
    assert store.current.server.port == 8005 and store.last_error is None


def test_reload_of_a_deleted_file_fails_cleanly(store):
    old = store.current
    store.path.unlink()
    assert store.changed_on_disk()
    ok, message = store.reload()
    assert not ok and "cannot read" in message and store.current is old
    assert not store.changed_on_disk()  # the missing file has been seen


def test_changed_on_disk(store):
    assert not store.changed_on_disk()
    write_toml(store.path, port=8006)
    bump_mtime(store.path)
    assert store.changed_on_disk()
    store.reload()
    assert not store.changed_on_disk()
    # A rejected version counts as seen, so a watcher does not retry it forever.
    store.path.write_text("not toml [")
    bump_mtime(store.path)
    assert store.changed_on_disk()
    assert not store.reload()[0]
    assert not store.changed_on_disk()


def test_changed_on_disk_sees_an_atomic_replace(store, tmp_path):
    # Editors and config managers often write a new file and rename it over.
    st = store.path.stat()
    replacement = tmp_path / "new.toml"
    replacement.write_bytes(store.path.read_bytes())
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime and size
    os.replace(replacement, store.path)
    assert store.changed_on_disk()


def test_parse_config_does_not_mutate_its_input():
    data = default_data()
    before = copy.deepcopy(data)
    parse_config(data)
    assert data == before
