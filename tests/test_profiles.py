from pathlib import Path

import pytest

from rsd_cli.errors import RsdError
from rsd_cli.profiles import load_profile
from rsd_cli.runtime import apply_flags, shape_of


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_profile_is_the_embedded_pair():
    profile = load_profile("default")
    assert profile["target"]["source"] == "embedded"
    assert profile["draft"]["kind"] == "early-exit"
    assert profile.origins["target"]["source"].endswith("default.toml")
    assert profile.origins["sampling"]["seed"] == "default"


def test_values_and_provenance(tmp_path):
    path = write(tmp_path, '[decoding]\nvariant = "rsd-s"\nbeam_width = 4\n[sampling]\ntemperature = 0\n')
    profile = load_profile(str(path), environ={"RSD_SAMPLING_TOP_K": "20"})
    assert profile["decoding"]["variant"] == "rsd-s"
    assert profile["sampling"]["temperature"] == 0.0 and isinstance(profile["sampling"]["temperature"], float)
    assert profile.origins["decoding"]["beam_width"] == str(path)
    assert profile["sampling"]["top_k"] == 20
    assert profile.origins["sampling"]["top_k"] == "env RSD_SAMPLING_TOP_K"
    apply_flags(profile, {"top_k": 5, "variant": None})
    assert profile["sampling"]["top_k"] == 5 and profile.origins["sampling"]["top_k"] == "flag --top-k"
    assert profile["decoding"]["variant"] == "rsd-s"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[sampling]\ntemprature = 1.0\n", "unknown key sampling.temprature (did you mean sampling.temperature?)"),
        ("[sampling]\nvariant = 'sd'\n", "unknown key sampling.variant (it belongs in [decoding]: decoding.variant)"),
        ("[sampling]\nwarmth = 1\n", "unknown key sampling.warmth (known: temperature, top_p,"),
        ("[sampler]\nx = 1\n", "unknown key 'sampler' (did you mean [sampling]?)"),
        ("temperature = 0.5\n", "unknown key 'temperature' (it belongs in [sampling]: sampling.temperature)"),
        ("source = 'x'\n", "unknown key 'source' (it belongs in [target]: target.source or [draft]: draft.source)"),
        ("colour = 1\n", "unknown key 'colour' (expected tables: target, draft,"),
        ('[sampling]\ntemperature = "hot"\n', "sampling.temperature must be a number"),
        ("[sampling]\ntemperature = -0.5\n", "sampling.temperature must be a finite number, at least 0"),
        ("[sampling]\ntemperature = inf\n", "sampling.temperature must be a finite number, at least 0"),
        ("[sampling]\nrepetition_penalty = inf\n", "sampling.repetition_penalty must be a finite number greater than 0"),
        ("[sampling]\ntop_p = 0\n", "sampling.top_p must be in (0, 1]"),
        ("[sampling]\ntop_p = 1.5\n", "sampling.top_p must be in (0, 1]"),
        ("[sampling]\nmax_tokens = 0\n", "sampling.max_tokens must be at least 1"),
        ("[decoding]\nbranching = [2, 0]\n", "decoding.branching must list factors of at least 1"),
        ("[decoding]\nbranching = []\n", "at least one branching factor"),
        ("[decoding]\nbeam_width = 0\n", "decoding.beam_width must be at least 1"),
        ("[decoding]\ndepth = 0\n", "decoding.depth must be at least 1"),
        ('[decoding]\nvariant = "fast"\n', "decoding.variant must be one of"),
        ("[draft]\nlayers = 1.5\n", "draft.layers must be an integer"),
        ("[sampling]\ntemperature = 1.0\n[sampling", "not valid TOML"),
        ("target = 3\n", "[target] must be a table"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(RsdError) as err:
        load_profile(str(path))
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_missing_profile_file_and_name(tmp_path):
    with pytest.raises(RsdError, match="profile file not found"):
        load_profile(str(tmp_path / "nope.toml"))
    with pytest.raises(RsdError, match="no profile named 'nope'"):
        load_profile("nope")


def test_user_profiles_live_in_the_config_dir_and_shadow_builtins(tmp_path, monkeypatch):
    folder = tmp_path / "cfg" / "profiles"
    folder.mkdir(parents=True)
    (folder / "mine.toml").write_text('[decoding]\nvariant = "ar"\n')
    (folder / "default.toml").write_text('[decoding]\nvariant = "mss"\n')
    monkeypatch.setenv("RSD_CONFIG_DIR", str(tmp_path / "cfg"))
    assert load_profile("mine")["decoding"]["variant"] == "ar"
    assert load_profile("default")["decoding"]["variant"] == "mss"
    monkeypatch.delenv("RSD_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "rsd" / "profiles").mkdir(parents=True)
    (tmp_path / "xdg" / "rsd" / "profiles" / "x.toml").write_text("")
    assert load_profile("x").name == "x"


def test_flag_and_env_values_are_validated_too():
    profile = load_profile("default", environ={})
    with pytest.raises(RsdError, match="flag --temperature: sampling.temperature must be a finite number, at least 0"):
        apply_flags(profile, {"temperature": -1.0})
    with pytest.raises(RsdError, match="decoding.branching must list factors of at least 1"):
        apply_flags(profile, {"branching": "3,0"})
    with pytest.raises(RsdError, match="integers separated by commas"):
        apply_flags(profile, {"branching": "3,x"})
    with pytest.raises(RsdError, match="RSD_SAMPLING_TEMPERATURE must be a number"):
        load_profile("default", environ={"RSD_SAMPLING_TEMPERATURE": "warm"})
    with pytest.raises(RsdError, match="budget must be at least 1"):
        apply_flags(profile, {"budget": 0})


@pytest.mark.parametrize("name, said", [
    ("RSD_SAMPLING_TEMPRATURE", "(did you mean RSD_SAMPLING_TEMPERATURE?)"),
    ("RSD_SAMPLING_VARIANT", "(did you mean RSD_DECODING_VARIANT?)"),  # another table's key
    ("RSD_RUNTIME_SPEED", "([runtime] takes RSD_RUNTIME_COMPILE)"),
    ("RSD_TEMPERATURE", "(did you mean RSD_SAMPLING_TEMPERATURE?)"),  # its table left out
    ("RSD_SOURCE", "(did you mean RSD_TARGET_SOURCE or RSD_DRAFT_SOURCE?)"),
])
def test_an_environment_variable_named_like_a_setting_but_none_is_refused(name, said):
    """RSD_SAMPLING_TEMPRATURE=0 left the temperature at the profile's without a word; refused as a
    profile's unknown key is. Other variables, rsd's own (RSD_CACHE_DIR, ...) included, are not."""
    with pytest.raises(RsdError) as err:
        load_profile("default", environ={name: "0"})
    assert str(err.value) == f"environment variable {name} is not a setting {said}"
    assert load_profile("default", environ={"RSD_CACHE_DIR": "/tmp", "RSD_DEBUG": "1", "RSD_SAMPLING_TOP_K": "3",
                                            "RSD_DECODINGS": "x", "RSD_ADAPTER_BLOCKS": "0", "RSD_PROFILE": "default",
                                            "RSD_CHAT_HISTORY": ""})["sampling"]["top_k"] == 3


def test_a_list_setting_takes_one_item_alone(tmp_path):
    """`stop = "\n\n"`, `stop_tokens = 198`, `branching = 3` were refused as "must be a list": one item
    is a list of one (true is not an integer there)."""
    profile = load_profile(str(write(tmp_path, '[decoding]\nbranching = 3\n[sampling]\nstop = "\\n\\n"\n'
                                                'stop_tokens = 198\n')), environ={})
    assert (profile["decoding"]["branching"], profile["sampling"]["stop"], profile["sampling"]["stop_tokens"]) == \
        ([3], ["\n\n"], [198])
    with pytest.raises(RsdError, match="sampling.stop_tokens must be a list of integers, got True"):
        load_profile(str(write(tmp_path, "[sampling]\nstop_tokens = true\n")), environ={})


def test_a_profile_s_paths_take_the_home_folder_and_its_own_folder(tmp_path, monkeypatch):
    """`source = "~/models/x"` was looked for as a folder named `~` (then as a hub id): no shell expands
    `~` in a TOML file, so rsd does, as it does for offload_folder; a relative path that exists beside
    the profile is taken from there, anything else (a hub id) as it is."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "profiles" / "mine").mkdir(parents=True)
    profile = load_profile(str(write(tmp_path / "profiles", '[target]\nsource = "~/models/x"\n')), environ={})
    assert profile.resolve_path(profile["target"]["source"]) == str(tmp_path / "home" / "models" / "x")
    assert profile.resolve_path("mine") == str(tmp_path / "profiles" / "mine")
    assert profile.resolve_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_shapes_from_profiles(tmp_path):
    profile = load_profile(str(write(tmp_path, '[decoding]\nvariant = "rsd-c"\nbranching = [3, 2, 2]\n')))
    assert shape_of(profile).branching == (3, 2, 2) and shape_of(profile).max_nodes == 1 + 3 + 6 + 12
    apply_flags(profile, {"budget": 10})
    assert shape_of(profile).max_nodes <= 10
    apply_flags(profile, {"variant": "rsd-s", "beam_width": 50, "budget": None})
    profile.set("decoding", "budget", 0, "test")
    with pytest.raises(RsdError, match="beam width 50 is larger than the vocabulary"):
        shape_of(profile, vocab_size=40)
