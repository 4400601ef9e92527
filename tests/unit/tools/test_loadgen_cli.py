"""capserve-loadgen run from a directory unrelated to the source tree finds its default corpus: it gets as far as
connecting (to a port nobody listens on) instead of failing on a relative ../shared path. The e2e loadgen smoke
test runs it against the real server from such a directory too.

Usage: test_loadgen_cli.py CAPSERVE_LOADGEN
"""
import subprocess
import sys
import tempfile
import unittest


class DefaultPaths(unittest.TestCase):
    def test_default_corpus_from_another_directory(self):
        with tempfile.TemporaryDirectory() as cwd:
            p = subprocess.run([sys.argv[1], "--target", "127.0.0.1:1", "--rate", "1", "--duration-s", "1",
                                "--connect-timeout-s", "1"], cwd=cwd, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("corpus", p.stderr)
        self.assertIn("cannot connect to 127.0.0.1:1", p.stderr)

    def test_empty_flag_value_is_an_error(self):
        # CLI11 would take the next flag as --model's value.
        p = subprocess.run([sys.argv[1], "--model=", "--rate", "1", "--target", "127.0.0.1:1"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--model= has an empty value", p.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
