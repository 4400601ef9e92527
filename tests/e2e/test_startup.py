"""Start-up errors: every refused flag (of capserve and capserve-generate) is a clear message naming it and exit
code 2, before any model is loaded; an empty API key, in any form, is refused (never a server without
authentication); more threads than cores is a warning at start;
a model that cannot be loaded is a one-line error, the last line of the job's output, exit code 1, with no
MPI_ABORT banner."""

import os
import subprocess
import sys
import tempfile
import unittest

from capserve_e2e import BIN, LAUNCH, MODEL, NP, Server, main

TIMEOUT_S = 120

BAD_FLAGS = [
    (["--max-running", "0"], "--max-running"),
    (["--kv-blocks", "0"], "--kv-blocks"),
    (["--kv-blocks", "-5"], "--kv-blocks"),
    (["--max-batched-tokens", "0"], "--max-batched-tokens"),
    (["--selector-window", "0"], "--selector-window"),
    (["--dry-run-layers", "-3"], "--dry-run-layers"),
    (["--port", "70000"], "--port"),
    (["--metrics-port", "-1"], "--metrics-port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--threads", "-2"], "--threads"),
    (["--max-context", "0"], "--max-context"),
    (["--selector-interval-ms", "-1"], "--selector-interval-ms"),
    (["--selector-max-wait-ms", "-1"], "--selector-max-wait-ms"),
    (["--selector-d", "0"], "--selector-d"),
    (["--step-timeout-s", "0"], "--step-timeout-s"),
    (["--default-max-tokens", "5000", "--max-tokens-limit", "4096"], "--default-max-tokens"),
    (["--speculative", "eagle"], "--speculative: eagle is not one of: none, ngram, mtp"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--speculative", "ngram", "--num-speculative-tokens", "17"], "--num-speculative-tokens"),
    (["--speculative", "ngram", "--ngram-max", "0"], "--ngram-max"),
    (["--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "4"],
     "--ngram-min (5) must not exceed --ngram-max (4)"),
    (["--ngram-max", "4"], "--ngram-max requires --speculative"),
    (["--kv-blocks=", "--max-running", "4"], "--kv-blocks= has an empty value"),  # CLI11 took --max-running
]


def launch(*flags, model=MODEL):
    cmd = ["bash", LAUNCH, str(NP), BIN, "--model", model, "--port", "0", "--metrics-port", "0", "--threads", "1",
           *flags]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    print(f"e2e: {' '.join(flags) or model} -> exit {done.returncode}:\n{done.stdout}", file=sys.stderr)
    return done.returncode, [line for line in done.stdout.splitlines() if line.strip()]


class StartupTest(unittest.TestCase):
    def test_bad_flags_exit_2_naming_the_flag(self):
        for flags, name in BAD_FLAGS:
            with self.subTest(flags=flags):
                code, lines = launch(*flags)
                self.assertEqual(code, 2, lines)
                self.assertTrue(any(name in line for line in lines), lines)
                self.assertFalse(any("serving" in line for line in lines), lines)

    def test_capserve_generate_bad_flags_exit_2(self):
        for flags in (["--kv-blocks", "0"], ["--threads", "0"], ["--top-k", "-1"], ["--capacity-rounds", "0"],
                      ["--seed=", "--ignore-eos"]):
            with self.subTest(flags=flags):
                cmd = ["bash", LAUNCH, str(NP), os.environ["CAPSERVE_GENERATE"], "--model", MODEL, "--input-ids",
                       "1 2 3", "--max-new-tokens", "2", *flags]
                done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=TIMEOUT_S)
                self.assertEqual(done.returncode, 2, done.stdout)
                self.assertIn(f"{flags[0]} has an empty value" if flags[0].endswith("=") else
                              f"{flags[0]}: must be at least", done.stdout)

    def test_empty_api_key_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            blank = os.path.join(tmp, "blank.key")
            with open(blank, "w") as f:
                f.write("  \n")
            config = os.path.join(tmp, "config.json")
            with open(config, "w") as f:
                f.write('{"api-key": ""}')
            # An unset variable (`--api-key "$KEY"`) is the empty separate argument.
            for flags, named in ((["--api-key", ""], "--api-key"), (["--api-key="], "--api-key="),
                                 (["--api-key-file", blank], f"--api-key-file {blank}"),
                                 (["--config", config], "--api-key")):
                with self.subTest(flags=flags):
                    server = Server(*flags, start_timeout=TIMEOUT_S)
                    self.addCleanup(server.stop)
                    with self.assertRaises(RuntimeError) as failed:
                        server.start()  # a server that starts is the defect: it would serve without a key
                    self.assertIn("did not start (exit 2)", str(failed.exception))
                    self.assertIn(named, str(failed.exception))
                    server.stop()

    def test_more_threads_than_cores_is_a_warning(self):
        cores = len(os.sched_getaffinity(0))
        with tempfile.TemporaryDirectory() as empty:
            cmd = ["bash", LAUNCH, str(NP), BIN, "--model", empty, "--port", "0", "--metrics-port", "0",
                   "--threads", str(cores)]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=TIMEOUT_S)
        print(f"e2e: --threads {cores} -> exit {done.returncode}:\n{done.stdout}", file=sys.stderr)
        self.assertIn(f"--threads {cores} x {NP} ranks on this host = {cores * NP} threads on {cores} cores",
                      done.stdout)

    def test_model_load_error_is_the_last_line(self):
        # The error is the last line of the job's stderr. stdout (rank 0's start-up lines) is a separate stream
        # that mpirun forwards on its own, so how the two interleave is up to mpirun's event loop, not the server.
        with tempfile.TemporaryDirectory() as empty:
            cmd = ["bash", LAUNCH, str(NP), BIN, "--model", empty, "--port", "0", "--metrics-port", "0",
                   "--threads", "1"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        print(f"e2e: empty model dir -> exit {done.returncode}:\n{done.stdout}{done.stderr}", file=sys.stderr)
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        everything = errors + done.stdout.splitlines()
        self.assertEqual(done.returncode, 1, everything)
        self.assertTrue(errors, everything)
        self.assertIn("config.json", errors[-1])
        self.assertTrue(errors[-1].startswith("capserve: "), errors)
        self.assertFalse(any("MPI_ABORT" in line or "Primary job" in line for line in everything), everything)

    def test_mtp_speculation_without_an_mtp_layer_is_a_load_error(self):
        # The default model (OLMoE) has no multi-token-prediction layer: every rank refuses, exit 1, the reason last.
        cmd = ["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port", "0", "--threads",
               "1", "--speculative", "mtp"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        self.assertEqual(done.returncode, 1, errors + done.stdout.splitlines())
        self.assertIn("needs exactly one multi-token-prediction layer (config.json's num_nextn_predict_layers)",
                      errors[-1])

    def test_a_load_map_that_cannot_be_used_is_a_start_error_naming_it(self):
        # Unreadable, or fitted for another model: every rank exits 1, rank 0's reason last, naming the file or the
        # model the map was fitted for.
        with tempfile.TemporaryDirectory() as tmp:
            other = os.path.join(tmp, "other_map.json")
            with open(other, "w") as f:
                f.write('{"format": "capserve-load-map/1", "model": {"architecture": "MixtralForCausalLM", '
                        '"moe_layers": 1, "experts": 1, "top_k": 1}, "ridge": 1, "weights": [0, 0]}')
            for path, reason in ((os.path.join(tmp, "absent.json"), "absent.json: cannot be opened"),
                                 (other, "fitted for a MixtralForCausalLM model of 1 MoE layers")):
                with self.subTest(path=path):
                    cmd = ["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port", "0",
                           "--threads", "1", "--load-map", path]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
                    errors = [line for line in done.stderr.splitlines() if line.strip()]
                    self.assertEqual(done.returncode, 1, errors + done.stdout.splitlines())
                    self.assertIn(reason, errors[-1])


if __name__ == "__main__":
    main()
