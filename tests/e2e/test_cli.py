"""The programs' command lines: --version on every binary (one version line, the same build for all), --help
showing each option's default and description (enum flags as "one of: ..."), a misspelt flag answered with the
closest one, capserve --config refusing an unknown key or a wrongly typed value by name (exit code 2, nothing
loaded), capserve-generate's stdout holding only the token ids (logs go to stderr), its --speculative ngram
and mtp giving the same tokens on 2 ranks with the acceptance on stderr, and its EPLB replicas
(--redundant-experts) the same tokens as without."""

import json
import os
import re
import subprocess
import tempfile
import unittest

from capserve_e2e import BIN, LAUNCH, MODEL, NP, main

VERSION = re.compile(r"^(\S+) (\d+\.\d+\.\d+ \(git \S+, \S+, CUDA support: (?:yes|no)\))$")


def run(cmd, timeout=120):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


class CliTest(unittest.TestCase):
    def test_version_on_every_binary(self):
        binaries = os.environ["CAPSERVE_CLI_BINARIES"].split(":")
        self.assertGreaterEqual(len(binaries), 5)
        builds = set()
        for path in binaries:
            with self.subTest(binary=os.path.basename(path)):
                done = run([path, "--version"])
                self.assertEqual(done.returncode, 0, done.stdout)
                m = VERSION.match(done.stdout.strip())
                self.assertIsNotNone(m, done.stdout)
                self.assertEqual(m.group(1), os.path.basename(path))
                builds.add(m.group(2))
        self.assertEqual(len(builds), 1, builds)

    def test_help_shows_defaults(self):
        done = run([BIN, "--help"])
        self.assertEqual(done.returncode, 0, done.stdout)
        lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip().startswith("--")}
        for flag, default in (("--max-running", "64"), ("--kv-blocks", "1024"), ("--log-level", "info"),
                              ("--batch-selector", "fcfs"), ("--capacity-factor", "inf"),
                              ("--fixed-exchange-tokens", "1024")):
            self.assertIn(flag, lines, done.stdout)
            self.assertIn(default, lines[flag])

    def test_misspelt_flag_suggests_the_closest(self):
        generate = os.environ["CAPSERVE_GENERATE"]
        for cmd, wrong, right in (([BIN, "--model", MODEL, "--max-runing", "4"], "--max-runing", "--max-running"),
                                  ([BIN, "--modle", MODEL], "--modle", "--model"),
                                  ([BIN, "--model", MODEL, "--capacity-polcy=drop"], "--capacity-polcy",
                                   "--capacity-policy"),
                                  ([generate, "--model", MODEL, "--input-ids", "1", "--max-new-token", "2"],
                                   "--max-new-token", "--max-new-tokens")):
            with self.subTest(flag=wrong):
                done = run(cmd)
                self.assertEqual(done.returncode, 2, done.stdout)
                self.assertIn(f"unknown flag {wrong} (did you mean {right}?)", done.stdout)

    def test_generate_prints_only_ids_on_stdout(self):
        # Logs go to stderr in every program: the deepseek_v3 fixture's multi-token-prediction layer makes the load
        # log a line, which spdlog's default logger printed on stdout between the token ids.
        generate = os.environ["CAPSERVE_GENERATE"]
        fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "models", "deepseek_v3")
        done = subprocess.run([generate, "--model", fixture, "--input-ids", "5 77 300", "--input-ids", "12 9",
                               "--max-new-tokens", "4", "--threads", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertRegex(done.stdout, r"\A(\d+ \d+ \d+ \d+\n){2}\Z")
        self.assertIn("multi-token-prediction layer 3", done.stderr)

    def test_generate_speculative_ngram_prints_the_same_tokens_and_its_acceptance(self):
        # Two prompts on 2 ranks (expert-parallel): n-gram drafts, verified in one step each, leave the greedy
        # tokens unchanged; stderr reports the drafts kept per position.
        generate = os.environ["CAPSERVE_GENERATE"]
        base = [generate, "--model", MODEL, "--prompt", "def add(a, b):\n    return a + b\n\ndef add(",
                "--prompt", "The sea. The sea. The", "--max-new-tokens", "40", "--threads", "1"]
        plain = subprocess.run(["bash", LAUNCH, str(NP)] + base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=300)
        spec = subprocess.run(["bash", LAUNCH, str(NP)] + base + ["--speculative", "ngram",
                                                                  "--num-speculative-tokens", "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        self.assertEqual(plain.returncode, 0, plain.stderr)
        self.assertEqual(spec.returncode, 0, spec.stderr)
        self.assertEqual(spec.stdout, plain.stdout)
        m = re.search(r"speculative decoding: (\d+) of (\d+) drafts kept \([\d.]+%\); kept/verified per position:"
                      r"( \d+/\d+){3}\n", spec.stderr)
        self.assertIsNotNone(m, spec.stderr)
        self.assertGreater(int(m.group(1)), 0)
        self.assertNotIn("speculative decoding", plain.stderr)
        for flags, message in ((["--speculative", "mtp"], "needs exactly one multi-token-prediction layer"),
                               (["--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"],
                                "--ngram-min (3) must not exceed --ngram-max (2)"),
                               (["--num-speculative-tokens", "2"], "--num-speculative-tokens requires --speculative"),
                               (["--speculative", "ngram", "--num-speculative-tokens", "17"],
                                "--num-speculative-tokens: Value 17 not in range 1 to 16")):
            with self.subTest(flags=flags):
                done = run([generate, "--model", MODEL, "--input-ids", "1 2", "--threads", "1"] + flags)
                self.assertNotEqual(done.returncode, 0, done.stdout)
                self.assertIn(message, done.stdout)

    def test_generate_speculative_mtp_prints_the_same_tokens(self):
        # DeepSeek-V3's MTP layer as the draft on 2 ranks (its experts spread over both, drafting a collective).
        generate = os.environ["CAPSERVE_GENERATE"]
        fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "models", "deepseek_v3")
        base = [generate, "--model", fixture, "--input-ids", "5 77 300", "--input-ids", "12 9 12 9",
                "--input-ids", "400", "--max-new-tokens", "24", "--threads", "1"]
        plain = subprocess.run(["bash", LAUNCH, str(NP)] + base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=300)
        spec = subprocess.run(["bash", LAUNCH, str(NP)] + base + ["--speculative", "mtp"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=300)
        self.assertEqual(plain.returncode, 0, plain.stderr)
        self.assertEqual(spec.returncode, 0, spec.stderr)
        self.assertEqual(spec.stdout, plain.stdout)
        self.assertRegex(spec.stderr, r"speculative decoding: \d+ of \d+ drafts kept")

    def test_generate_with_redundant_experts_prints_the_same_tokens(self):
        # EPLB replicas on 2 ranks: the statistics of one run (--moe-stats) give the hottest experts extra copies
        # (--redundant-experts): the same greedy tokens, each copy's load in the new statistics, and replicas
        # without statistics (or more than the ranks can hold) refused by what is wrong.
        generate = os.environ["CAPSERVE_GENERATE"]
        base = [generate, "--model", MODEL, "--prompt", "Tell me about the sea.", "--prompt",
                "Write a short story about a robot.", "--max-new-tokens", "12", "--threads", "1"]
        with tempfile.TemporaryDirectory() as tmp:
            stats = os.path.join(tmp, "stats.json")
            plain = subprocess.run(["bash", LAUNCH, str(NP)] + base + ["--moe-stats", stats], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, timeout=300)
            self.assertEqual(plain.returncode, 0, plain.stderr)
            again = os.path.join(tmp, "replicated.json")
            replicated = subprocess.run(["bash", LAUNCH, str(NP)] + base + [
                "--expert-placement", stats, "--redundant-experts", "2", "--moe-stats", again],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
            self.assertEqual(replicated.returncode, 0, replicated.stderr)
            self.assertEqual(replicated.stdout, plain.stdout)
            with open(again) as f:
                written = json.load(f)
            self.assertIn("placement=replicated", written["config"])
            layers = written["layers"]
            for layer in layers:
                experts = len(layer["routed_load"])
                self.assertEqual(len(layer["slot_load"]), experts + 2, layer["layer"])
                self.assertEqual(sum(layer["slot_load"]), sum(layer["expert_load"]), layer["layer"])
            for flags, message in ((["--redundant-experts", "2"], "redundant expert slots are chosen from measured"),
                                   (["--expert-placement", stats, "--redundant-experts", "1000"],
                                    "at most one copy of an expert per rank"),
                                   (["--expert-placement", stats, "--redundant-experts", "2", "--capacity-factor",
                                     "1.5", "--capacity-granularity", "device"], "need one rank per expert")):
                with self.subTest(flags=flags):
                    done = run(["bash", LAUNCH, str(NP)] + base + flags, timeout=300)
                    self.assertNotEqual(done.returncode, 0, done.stdout)
                    self.assertIn(message, done.stdout)

    def test_memory_plan_verdicts_and_exit_codes(self):
        # DeepSeek-V3's released config on 8 x 141 GB: fits with FP8 kept (exit 0), not dequantized (exit 3); a
        # size it cannot read is an error naming it (exit 1), a config that is not there a refused command line.
        plan = os.environ["CAPSERVE_MEMORY_PLAN"]
        config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "configs", "deepseek_v3",
                              "config.json")
        base = [plan, "--model-config", config, "--ranks", "8", "--device-memory", "141GB", "--kv-dtype", "bf16"]
        kept = subprocess.run(base + ["--fp8", "keep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=60)
        self.assertEqual(kept.returncode, 0, kept.stderr)
        self.assertEqual(kept.stderr, "")  # nothing logged: the plan loads nothing
        rows = [line for line in kept.stdout.splitlines() if re.match(r"^\s+\d+\s+1856\s", line)]
        self.assertEqual(len(rows), 8, kept.stdout)
        self.assertTrue(all(row.endswith("FITS") for row in rows), kept.stdout)
        self.assertEqual(kept.stdout.splitlines()[-1], "FITS")
        tokens = int(re.search(r"--kv-blocks \d+ \((\d+) tokens", kept.stdout).group(1))
        self.assertGreaterEqual(tokens, 100_000)
        bf16 = subprocess.run(base + ["--fp8", "dequantize"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=60)
        self.assertEqual(bf16.returncode, 3, bf16.stderr)
        self.assertEqual(bf16.stdout.splitlines()[-1], "DOES NOT FIT")
        bad = run([plan, "--model-config", config, "--device-memory", "141XB"])
        self.assertEqual(bad.returncode, 1, bad.stdout)
        self.assertIn("'141XB' is not a size", bad.stdout)
        missing = run([plan, "--model-config", config + ".missing", "--device-memory", "141GB"])
        self.assertEqual(missing.returncode, 2, missing.stdout)

    def test_help_describes_every_option_in_words(self):
        generate = os.environ["CAPSERVE_GENERATE"]
        for program in (BIN, generate):
            with self.subTest(program=os.path.basename(program)):
                done = run([program, "--help"])
                self.assertEqual(done.returncode, 0, done.stdout)
                for internal in ("ENUM", "->", " OR {"):
                    self.assertNotIn(internal, done.stdout)
                policy = next(line for line in done.stdout.splitlines() if line.strip().startswith("--capacity-policy"))
                self.assertIn("one of: none, drop, reroute, expanded", policy)
                self.assertNotIn("checkpoint on the CPU;", done.stdout)  # capserve-generate has --device cuda
        lines = {line.split()[0]: line for line in run([BIN, "--help"]).stdout.splitlines()
                 if line.strip().startswith("--")}
        self.assertRegex(lines["--selector-seed"], r"--selector-seed \S+\s+\w+ \w+")  # a description after the type

    def test_enum_flag_error_lists_the_choices(self):
        done = run([BIN, "--model", MODEL, "--capacity-policy", "dorp"])
        self.assertEqual(done.returncode, 2, done.stdout)
        self.assertIn("--capacity-policy: dorp is not one of: none, drop, reroute, expanded", done.stdout)
        self.assertNotIn("->", done.stdout)

    def config_refused(self, config):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config, f)
        self.addCleanup(os.unlink, f.name)
        done = run(["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port", "0",
                    "--config", f.name])
        self.assertEqual(done.returncode, 2, done.stdout)
        self.assertNotIn("serving", done.stdout)
        return done.stdout

    def test_config_unknown_key_is_refused_by_name(self):
        out = self.config_refused({"max-runing": 8})
        self.assertIn('unknown key "max-runing" (did you mean "max-running"?)', out)

    def test_config_wrong_type_is_refused_by_name(self):
        self.assertIn('"max-running" must be an integer, got "eight"', self.config_refused({"max-running": "eight"}))
        self.assertIn('"metrics-per-expert" is a flag: true or false, got 1',
                      self.config_refused({"metrics-per-expert": 1}))

    def test_prefix_cache_with_speculation_is_refused(self):
        # The scheduler's per-rank mirror of the KV blocks does not follow draft blocks yet: --speculative turns
        # the prefix cache's default off, and asking for both is refused before anything is loaded.
        message = "--prefix-cache does not work with --speculative yet"
        done = run(["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port", "0",
                    "--speculative", "ngram", "--prefix-cache"])
        self.assertEqual(done.returncode, 2, done.stdout)
        self.assertIn(message, done.stdout)
        self.assertNotIn("serving", done.stdout)
        self.assertIn(message, self.config_refused({"speculative": "ngram", "prefix-cache": True}))


if __name__ == "__main__":
    main()
