"""Configuration: TOML files, flags, and start-up errors that say where and why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.config import ClusterConfig, ConfigError, hash_token, load_config, path_forms
from node.rules import Rule
from router.cli import build_parser, cluster_config
from tests.processes import ROOT

GOOD = """
[[rules]]
name = "global"
rate = "100/minute"

[[rules]]
name = "writes"
limit = 10
period = "10s"
algorithm = "sliding-window"
methods = ["post", "PUT"]
paths = ["/api/*"]
on_error = "closed"

[[rules]]
name = "gold"
rate = "1000 per hour"
burst = 50
tiers = ["gold"]
crash_policy = "conservative"

[identity]
source = "header"
name = "X-Api-User"
tier_header = "X-Plan"
trusted_proxies = ["10.0.0.0/8"]

[limits]
max_key_length = 64
max_batch = 10

[headers]
legacy = false

[bypass]
header = "X-Pass"
tokens = ["plain-token"]
token_sha256 = ["{digest}"]

[policies]
rebalance = "reset"
crash = "conservative"
""".replace("{digest}", hash_token("other-token"))


def write(tmp_path: Path, text: str, name: str = "ringlimit.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_config_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert [s.rule.name for s in config.rules] == ["global", "writes", "gold"]
    writes = config.rule("writes")
    assert writes is not None
    assert (writes.limit, writes.period, writes.algorithm) == (10, 10.0, "sliding_window")
    assert writes.on_error == "closed"
    gold = config.rule("gold")
    assert gold is not None and (gold.limit, gold.period, gold.burst) == (1000, 3600.0, 50)
    assert config.rules[1].methods == ("POST", "PUT")
    assert config.default_rules == (config.rule("global"),)
    assert config.identity.name == "X-Api-User" and config.identity.tier_header == "X-Plan"
    assert config.limits.max_key_length == 64 and config.limits.max_body == 1 << 20
    assert config.legacy_headers is False
    assert config.bypass_header == "X-Pass"
    assert config.policies.rebalance == "reset"


def test_scopes_select_every_matching_rule(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))

    def names(method: str, path: str, tier: str | None) -> list[str]:
        return [r.name for r in config.rules_for(method, path, tier)]

    assert names("GET", "/api/x", None) == ["global"]
    assert names("POST", "/api/x", None) == ["global", "writes"]
    assert names("post", "/api/x/y", "gold") == ["global", "writes", "gold"]
    assert names("POST", "/other", "gold") == ["global", "gold"]
    assert names("DELETE", "/api/x", "silver") == ["global"]


@pytest.mark.parametrize(
    ("path", "canonical"),
    [
        ("/api/login", "/api/login"),
        ("//api///login", "/api/login"),
        ("/api/login/", "/api/login"),
        ("/api/login;jsessionid=1", "/api/login"),
        ("/api;v=2/login;x/", "/api/login"),
        ("/api\\login", "/api/login"),
        ("/x/./y/../../api/login", "/api/login"),
        ("/../../api/login", "/api/login"),
    ],
)
def test_path_forms_undo_the_spellings_an_application_may_merge(path: str, canonical: str) -> None:
    forms = path_forms(path)
    assert forms[0] == path  # as it arrived, first
    assert canonical in forms and canonical + "/" in forms


#: Ways to spell one step of a path ("/" + segment) that applications read alike.
SPELLINGS = {
    "plain": "/{}",
    "doubled": "//{}",
    "parameter": "/{};p=1",
    "backslash": "\\{}",
    "dot": "/./{}",
    "up": "/x/../{}",
}


@given(
    st.lists(
        st.tuples(st.text(alphabet="ab", min_size=1, max_size=3), st.sampled_from(list(SPELLINGS))),
        min_size=1,
        max_size=5,
    ),
    st.booleans(),
)
def test_any_spelling_of_a_path_has_the_path_among_its_forms(
    steps: list[tuple[str, str]], trailing: bool
) -> None:
    canonical = "".join(f"/{segment}" for segment, _ in steps)
    spelled = "".join(SPELLINGS[how].format(segment) for segment, how in steps)
    spelled = ("" if spelled.startswith("/") else "/") + spelled + ("/" if trailing else "")
    forms = path_forms(spelled)
    assert forms[0] == spelled and canonical in forms and canonical + "/" in forms


def test_path_forms_of_the_root_and_of_non_paths() -> None:
    assert path_forms("/") == ("/",)
    assert path_forms("///") == ("///", "/")
    assert path_forms("*") == ("*",) and path_forms("") == ("",)


def test_a_scope_matches_any_spelling_of_its_paths(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    for path in ("/api/x", "//api/x", "/api/x;a=b", "/api", "/api/"):
        assert "writes" in [r.name for r in config.rules_for("POST", path, None)], path
    for path in ("/apix", "/x/api/x", "/"):
        assert "writes" not in [r.name for r in config.rules_for("POST", path, None)], path


def test_lease_is_off_by_default_and_auto_per_rule(tmp_path: Path) -> None:
    text = GOOD + '\n[[rules]]\nname = "hot"\nrate = "1000/minute"\nlease = "auto"\n'
    config = load_config(write(tmp_path, text))
    hot, writes = config.rule("hot"), config.rule("writes")
    assert hot is not None and hot.lease == "auto"
    assert writes is not None and writes.lease == "off"
    assert hot.to_dict()["lease"] == "auto" and "lease" not in writes.to_dict()
    assert Rule.from_dict(hot.to_dict()) == hot


def test_bypass_tokens_are_kept_only_as_sha256(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    config = load_config(path)
    assert set(config.bypass_sha256) == {hash_token("plain-token"), hash_token("other-token")}
    wire = json.dumps(config.to_dict())
    assert "plain-token" not in wire and "other-token" not in wire
    # The config survives the trip to the nodes.
    again = ClusterConfig.from_dict(config.to_dict())
    assert again.rules == config.rules and again.bypass_sha256 == config.bypass_sha256
    assert again.identity == config.identity and again.limits == config.limits


RULE = '[[rules]]\nname = "ok"\nrate = "5/minute"\n'

BAD: list[tuple[str, str, list[str]]] = [
    (
        "bad rate",
        RULE + '[[rules]]\nname = "b"\nrate = "5/fortnight"\n',
        ["rules[1].rate", "fortnight"],
    ),
    ("rate not a string", '[[rules]]\nname = "b"\nrate = 5\n', ["rules[0].rate", "string"]),
    ("limit zero", '[[rules]]\nname = "b"\nlimit = 0\nperiod = 60\n', ["rules[0].limit"]),
    (
        "limit float",
        '[[rules]]\nname = "b"\nlimit = 1.5\nperiod = 60\n',
        ["rules[0].limit", "integer"],
    ),
    ("period list", '[[rules]]\nname = "b"\nlimit = 1\nperiod = [1]\n', ["rules[0].period"]),
    (
        "period bad unit",
        '[[rules]]\nname = "b"\nlimit = 1\nperiod = "1 jiffy"\n',
        ["rules[0].period", "jiffy"],
    ),
    ("period negative", '[[rules]]\nname = "b"\nlimit = 1\nperiod = -1\n', ["rules[0].period"]),
    ("bad algorithm", RULE + 'algorithm = "magic"\n', ["rules[0].algorithm", "magic"]),
    ("algorithm not a string", RULE + "algorithm = 3\n", ["rules[0].algorithm"]),
    ("bad on_error", RULE + 'on_error = "maybe"\n', ["rules[0].on_error"]),
    ("bad crash_policy", RULE + 'crash_policy = "pray"\n', ["rules[0].crash_policy"]),
    ("bad burst", RULE + "burst = -3\n", ["rules[0].burst"]),
    ("empty burst", RULE + 'burst = ""\n', ["rules[0].burst"]),
    ("burst an empty list", RULE + "burst = []\n", ["rules[0].burst"]),
    ("burst an empty table", RULE + "burst = {}\n", ["rules[0].burst"]),
    ("tier header an empty list", "[identity]\ntier_header = []\n", ["identity.tier_header"]),
    ("tier header zero", "[identity]\ntier_header = 0\n", ["identity.tier_header"]),
    ("bad name", '[[rules]]\nname = "has space"\nrate = "5/minute"\n', ["rules[0].name"]),
    ("missing name", '[[rules]]\nrate = "5/minute"\n', ["rules[0]", "name"]),
    ("rate and limit", RULE + "limit = 5\n", ["rules[0]", "not both"]),
    ("no rate", '[[rules]]\nname = "b"\n', ["rules[0]", "rate"]),
    ("unknown rule key", RULE + "limt = 5\n", ["rules[0]", "unknown key(s) limt"]),
    ("methods not strings", RULE + "methods = [1]\n", ["rules[0].methods"]),
    ("method not a token", RULE + 'methods = ["GET", "GÉT"]\n', ["rules[0].methods[1]", "GÉT"]),
    ("path empty", RULE + 'paths = [""]\n', ["rules[0].paths[0]", "can match no path"]),
    ("path relative", RULE + 'paths = ["api/*"]\n', ["rules[0].paths[0]", "'/' or '*'"]),
    ("path control char", RULE + 'paths = ["/a\\tb"]\n', ["rules[0].paths[0]"]),
    ("tier empty", RULE + 'tiers = ["gold", ""]\n', ["rules[0].tiers[1]", "non-empty"]),
    ("method star", RULE + 'methods = ["*"]\n', ["rules[0].methods[0]", "leave methods out"]),
    ("path a URL", RULE + 'paths = ["https://a.example/v1/*"]\n', ["such as '/v1/*'"]),
    # fnmatch makes an empty range '(?!)': accepted, it matched nothing (a tester).
    ("path empty range", RULE + 'paths = ["/[z-a]"]\n', ["paths[0]", "range is empty"]),
    # One rule of 100,000 patterns held each node's loop 2.3 s at its first request.
    (
        "paths too many",
        RULE + "paths = [" + ", ".join(f'"/p{i}"' for i in range(257)) + "]\n",
        ["rules[0].paths", "257 patterns; at most 256 per rule"],
    ),
    ("path too long", RULE + 'paths = ["/' + "a" * 1024 + '"]\n', ["1,025 characters"]),
    (
        "paths too many in all",
        "".join(
            f'[[rules]]\nname = "r{r}"\nrate = "1/s"\npaths = ['
            + ", ".join(f'"/p{i}"' for i in range(256))
            + "]\n"
            for r in range(17)
        ),
        ["rules", "4,352 paths patterns in all; at most 4,096"],
    ),
    # A full-width digit was read as 5 (\d is any script's digit).
    ("rate full-width digit", '[[rules]]\nname = "a"\nrate = "\uff15/second"\n', ["rules[0].rate"]),
    ("duplicate names", RULE + RULE, ["used twice"]),
    ("rules a table", '[rules]\nname = "x"\n', ["rules", "array"]),
    ("unknown top-level key", 'colour = "red"\n' + RULE, ["top level", "colour"]),
    ("unknown table", RULE + "[server]\nport = 1\n", ["top level", "server"]),
    ("identity source", '[identity]\nsource = "cookie"\n', ["identity.source", "cookie"]),
    ("identity unknown key", '[identity]\nsauce = "header"\n', ["identity", "sauce"]),
    ("identity name type", "[identity]\nname = 5\n", ["identity.name"]),
    # int() of 5,000 digits raised its own error (sys.set_int_max_str_digits).
    (
        "rate of 5,000 digits",
        '[[rules]]\nname = "a"\nrate = "' + "9" * 5000 + '/minute"\n',
        ["rules[0].rate", "the count must be 1..1000000000"],
    ),
    # Names no request could carry: a user id never found, a bypass never matched.
    ("identity name no header", '[identity]\nname = "X User"\n', ["identity.name", "X User"]),
    ("tier header no header", '[identity]\ntier_header = "X:T"\n', ["identity.tier_header"]),
    ("bypass header no header", '[bypass]\nheader = "X Bad"\n', ["bypass.header", "X Bad"]),
    (
        "fallback not bool",
        '[identity]\nfallback_to_client = "false"\n',
        ["identity.fallback_to_client"],
    ),
    (
        "bad proxy",
        '[identity]\ntrusted_proxies = ["not-an-ip"]\n',
        ["identity.trusted_proxies", "not-an-ip"],
    ),
    ("limits negative", "[limits]\nmax_body = -1\n", ["limits.max_body"]),
    # Bounded themselves: a key longer than a request's head can carry once
    # percent-encoded was accepted, and then every forward of it refused.
    (
        "limits too large",
        "[limits]\nmax_key_length = 4097\n",
        ["limits.max_key_length", "at most 4,096", "got 4,097"],
    ),
    ("body too large", "[limits]\nmax_body = 1073741825\n", ["limits.max_body", "at most"]),
    ("cost too large", "[limits]\nmax_cost = 1000000001\n", ["limits.max_cost", "at most"]),
    ("batch too large", "[limits]\nmax_batch = 100001\n", ["limits.max_batch", "at most"]),
    ("limits string", '[limits]\nmax_batch = "10"\n', ["limits.max_batch"]),
    # Said in the file's spelling: it said "got True" (an exploratory tester).
    ("limits bool", "[limits]\nmax_cost = true\n", ["limits.max_cost", "got true"]),
    ("headers.legacy array", "[headers]\nlegacy = [1]\n", ["headers.legacy", "got an array"]),
    ("limits unknown", "[limits]\nmax_bdy = 1\n", ["limits", "max_bdy"]),
    ("legacy not bool", '[headers]\nlegacy = "no"\n', ["headers.legacy"]),
    ("bypass digest", '[bypass]\ntoken_sha256 = ["abc"]\n', ["bypass.token_sha256"]),
    ("bypass header", "[bypass]\nheader = 1\n", ["bypass.header"]),
    ("policy", '[policies]\nrebalance = "shuffle"\n', ["policies.rebalance", "shuffle"]),
    ("interval", '[policies]\nreplication_interval = "fast"\n', ["policies.replication_interval"]),
    ("backend", 'backend = "etcd"\n', ["backend"]),
    (
        "lease mode",
        '[[rules]]\nname = "a"\nrate = "5/second"\nlease = "always"\n',
        ["rules[0].lease", "always"],
    ),
    (
        "lease sliding log",
        '[[rules]]\nname = "a"\nrate = "5/second"\nalgorithm = "sliding_log"\nlease = "auto"\n',
        ["rules[0].lease", "sliding_log"],
    ),
    ("not toml", "[[rules]\nname=", ["not valid TOML"]),
]


@pytest.mark.parametrize(
    "path",
    [
        "/\u0645\u0642\u0627\u0644\u0647\u200c\u0647\u0627/*",  # Persian: a ZWNJ in a word
        "/tags/\U0001f468\u200d\U0001f469\u200d\U0001f467",  # an emoji family: ZWJs
        "/docs/a\u00a0b",  # NBSP, as %C2%A0 decodes
    ],
)
def test_a_path_with_format_characters_is_text_not_control(path: str) -> None:
    """Only control characters make a pattern useless (str.isprintable() would
    refuse these too: the review of the check)."""
    config = ClusterConfig.from_dict({"rules": [{"name": "r", "rate": "1/s", "paths": [path]}]})
    assert config.rules_for("GET", path.replace("*", "x"), None)


@pytest.mark.parametrize("data", [None, [], "rules", 0])
def test_a_config_that_is_not_a_table_is_refused_not_taken_as_empty(data: Any) -> None:
    """A push with ``"config": null`` was taken as no rules at all: it wiped a
    node's rules."""
    with pytest.raises(ConfigError, match="top level: must be a table"):
        ClusterConfig.from_dict(data, source="pushed config", strict=False)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"rules": [{"name": "r", "rate": "1/s", "tiers": ["\ud800"]}]}, "rules[0].tiers[0]"),
        ({"identity": {"name": "X-\udc00"}}, "identity.name"),
        ({"privacy": {"\ud800": 1}}, "privacy.'\\ud800'"),
    ],
)
def test_text_no_push_can_carry_is_refused_where_it_is(data: Any, where: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{where}: not valid Unicode")):
        ClusterConfig.from_dict(data, source="pushed config", strict=False)


def test_a_redis_backend_balances_round_robin_unless_told_otherwise() -> None:
    """As docs/configuration.md says: a file's backend = "redis" alone routed by
    owner (sticky) over nodes that own no keys (the review)."""
    redis = ClusterConfig.from_dict({"backend": "redis"})
    assert redis.balance == "round-robin"
    told = ClusterConfig.from_dict({"backend": "redis", "balance": "sticky"})
    assert told.balance == "sticky"
    assert ClusterConfig.from_dict({}).balance == "sticky"


def test_a_useless_rule_from_another_process_is_kept_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a router or node reads from etcd, a push or a leader (not strict):
    an older version accepted these, and refusing them would make an upgraded
    node refuse its router's pushes (removed as crashed)."""
    data = {"rules": [{"name": "r", "rate": "1/s", "paths": [""], "methods": ["GÉT"]}]}
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(data)
    with caplog.at_level("WARNING", logger="ringlimit.config"):
        config = ClusterConfig.from_dict(data, source="pushed config", strict=False)
    assert config.rules[0].paths == ("",) and config.rules[0].methods == ("GÉT",)
    assert "rules[0].paths[0]" in caplog.text and "rules[0].methods[0]" in caplog.text
    # So is one past a size limit a version before the limit took (300 patterns).
    many = {"rules": [{"name": "r", "rate": "1/s", "paths": [f"/p{i}" for i in range(300)]}]}
    with pytest.raises(ConfigError, match="at most 256 per rule"):
        ClusterConfig.from_dict(many)
    with caplog.at_level("WARNING", logger="ringlimit.config"):
        kept = ClusterConfig.from_dict(many, source="etcd record", strict=False)
    assert len(kept.rules[0].paths) == 300
    assert "300 patterns; at most 256 per rule" in caplog.text


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_errors_name_the_file_the_key_and_the_problem(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    for part in expected:
        assert part in message, (part, message)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory
    bad_json = write(tmp_path, "{", "c.json")
    with pytest.raises(ConfigError, match=r"c\.json: not valid JSON"):
        load_config(bad_json)


def args(*argv: str) -> object:
    return build_parser().parse_args(["node", "--id", "n1", "--port", "1", *argv])


def test_flags_build_rules_and_add_to_the_config_file(tmp_path: Path) -> None:
    default = cluster_config(args())
    assert [s.rule.spec for s in default.rules] == ["10/minute"]
    flags = cluster_config(
        args("--rule", "100/minute", "--rule", "api=5/10s", "--algorithm", "gcra")
    )
    assert [(s.rule.name, s.rule.limit, s.rule.period, s.rule.algorithm) for s in flags.rules] == [
        ("100-per-minute", 100, 60.0, "gcra"),
        ("api", 5, 10.0, "gcra"),
    ]
    path = write(tmp_path, GOOD)
    combined = cluster_config(args("--config", str(path), "--rule", "extra=1/second"))
    assert [s.rule.name for s in combined.rules] == ["global", "writes", "gold", "extra"]
    only_file = cluster_config(args("--config", str(path), "--user-header", "X-Who"))
    assert len(only_file.rules) == 3 and only_file.identity.name == "X-Who"


def run_cli(*commands: list[str], timeout: float = 30.0) -> list[tuple[int, str]]:
    """Run several ``ringlimit`` commands at once; (exit code, stderr) of each."""
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "router", *argv],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in commands
    ]
    results = []
    for process in running:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        results.append((process.returncode, stderr))
    return results


def test_bad_configs_rules_and_apps_exit_non_zero_at_start_up(tmp_path: Path) -> None:
    bad = write(tmp_path, RULE + '[[rules]]\nname = "b"\nrate = "lots"\n', "bad.toml")
    typed = write(tmp_path, '[[rules]]\nname = "b"\nlimit = 1\nperiod = [1]\n', "typed.toml")
    node = ["node", "--id", "n1", "--port", "1"]
    results = run_cli(
        [*node, "--config", str(bad)],
        ["router", "--port", "1", "--config", str(typed)],
        ["up", "--port", "1", "--config", str(bad)],
        [*node, "--rule", "5/fortnight"],
        [*node, "--algorithm", "magic"],
        [*node, "--app", "tests.nowhere:app"],
    )
    expected = [
        f"{bad}: rules[1].rate",
        f"{typed}: rules[0].period",
        f"{bad}: rules[1].rate",
        "unknown time unit 'fortnight'",
        "unknown algorithm 'magic'",
        "cannot import 'tests.nowhere'",
    ]
    for (code, stderr), message in zip(results, expected, strict=True):
        assert code == 2, stderr
        assert stderr.startswith("ringlimit: error: ") and message in stderr, stderr
        assert "Traceback" not in stderr


#: The documents whose ```toml blocks are ringlimit config files (docs/simulations.md's
#: are scenarios).
CONFIG_DOCS = ("docs/configuration.md", "docs/operations.md")


def toml_blocks(document: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", (ROOT / document).read_text(), re.M | re.S)


@pytest.mark.parametrize("document", CONFIG_DOCS)
def test_every_config_example_in_the_docs_loads(document: str, tmp_path: Path) -> None:
    """An operator copies an example into ringlimit.toml and starts a router with it.
    Before, docs/configuration.md's full example stopped start-up: its
    ``token_sha256 = ["<sha256 hex of a partner token>"]`` placeholder is no hash."""
    blocks = toml_blocks(document)
    assert blocks, f"no ```toml block in {document}"
    for number, block in enumerate(blocks):
        path = tmp_path / f"example{number}.toml"
        path.write_text(block)
        load_config(path)
