"""The roce_gather Python package's own logic, on any machine with python3: the environment a
job gets (job_env, set_env), the refusals, and python -m roce_gather's commands, run against a
copy of the package with a stand-in library and plugincheck. tests/wheel installs the real wheel;
plugin/config_python_test.go checks the rules against plugin/config.go.

    python3 tests/python/test_roce_gather.py [-v]
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import roce_gather  # noqa: E402
from roce_gather import settings  # noqa: E402

LIB = "/opt/wheel/roce_gather/lib/libroce_gather.so"


def job_env(environ=None, **given):
    return roce_gather._job_env(environ or {}, LIB, given)


class SettingsTest(unittest.TestCase):
    def test_keywords_are_the_variables_lower_case_without_the_prefix(self):
        self.assertEqual("max_bytes", settings.keyword("ROCE_GATHER_MAX_BYTES"))
        self.assertEqual("ROCE_GATHER_MAX_BYTES", settings.variable("max_bytes"))
        self.assertEqual("ROCE_GATHER_MAX_BYTES", settings.variable("MAX_BYTES"))
        self.assertEqual("ROCE_GATHER_MAX_BYTES", settings.variable("ROCE_GATHER_MAX_BYTES"))
        self.assertIsNone(settings.variable("max_byte"))
        self.assertIsNone(settings.variable("ROCE_GATHER_max_bytes"))

    def test_parse_bytes_takes_k_m_g_as_powers_of_1024(self):
        self.assertEqual((512, None), settings.parse_bytes("512"))
        self.assertEqual((256 << 10, None), settings.parse_bytes("256K"))
        self.assertEqual((4 << 20, None), settings.parse_bytes(" 4 mib "))
        self.assertEqual((1 << 30, None), settings.parse_bytes("1GB"))
        self.assertEqual((None, "want digits with an optional K, M or G suffix"), settings.parse_bytes("1.5M"))
        self.assertEqual((None, "want digits with an optional K, M or G suffix"), settings.parse_bytes("-1"))
        self.assertEqual((None, "too large"), settings.parse_bytes("17179869184G"))

    def test_refusal_words_match_the_librarys(self):
        self.assertIsNone(settings.refusal("ROCE_GATHER_MAX_BYTES", "64M"))
        self.assertEqual("is outside 1..67108864", settings.refusal("ROCE_GATHER_MAX_BYTES", "65M"))
        self.assertEqual("is outside 1..67108864", settings.refusal("ROCE_GATHER_MAX_BYTES", "0"))
        self.assertIsNone(settings.refusal("ROCE_GATHER_MIN_BYTES", "0"))
        self.assertEqual('item "mlx5_0:0" has a port that is not 1 to 255',
                         settings.refusal("ROCE_GATHER_HCAS", "mlx5_1, mlx5_0:0"))
        self.assertEqual("is not a multiple of 4096 bytes from 4096 to 16777216",
                         settings.refusal("ROCE_GATHER_CHUNK_BYTES", "1000"))
        self.assertIsNone(settings.refusal("ROCE_GATHER_FABRIC", "  "), "empty: the library ignores it")

    def test_go_quote_escapes_as_go_does(self):
        self.assertEqual(r'"a\"b\\c\td\x01"', settings.go_quote('a"b\\c\td\x01'))


class JobEnvTest(unittest.TestCase):
    def test_plugin_path_and_ref_count_by_default(self):
        env = job_env()
        self.assertEqual([("NCCL_NET_PLUGIN", LIB), ("NCCL_NET_PLUGIN_REF_COUNT", "1")], list(env.items()))

    def test_a_ref_count_already_set_is_kept(self):
        self.assertEqual("0", job_env({"NCCL_NET_PLUGIN_REF_COUNT": "0"})["NCCL_NET_PLUGIN_REF_COUNT"])

    def test_settings_by_keyword_or_variable_in_the_order_given(self):
        env = job_env(fabric="tcp", ROCE_GATHER_MAX_BYTES="256K", timeout_ms=5000, enable=False, chunk_bytes=8192)
        self.assertEqual(["NCCL_NET_PLUGIN", "NCCL_NET_PLUGIN_REF_COUNT", "ROCE_GATHER_FABRIC",
                          "ROCE_GATHER_MAX_BYTES", "ROCE_GATHER_TIMEOUT_MS", "ROCE_GATHER_ENABLE",
                          "ROCE_GATHER_CHUNK_BYTES"], list(env))
        self.assertEqual(("tcp", "256K", "5000", "0", "8192"),
                         (env["ROCE_GATHER_FABRIC"], env["ROCE_GATHER_MAX_BYTES"], env["ROCE_GATHER_TIMEOUT_MS"],
                          env["ROCE_GATHER_ENABLE"], env["ROCE_GATHER_CHUNK_BYTES"]))

    def test_values_are_trimmed_as_the_library_trims_them(self):
        self.assertEqual("64K", job_env(max_bytes=" 64K\t")["ROCE_GATHER_MAX_BYTES"])

    def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(self):
        with self.assertRaises(ValueError) as cm:
            job_env(max_bytes="65M")
        self.assertEqual('ROCE_GATHER_MAX_BYTES="65M" is outside 1..67108864', str(cm.exception))

    def test_every_problem_is_named_at_once(self):
        with self.assertRaises(ValueError) as cm:
            job_env({"ROCE_GATHER_FABRIC": "ib"}, fabric_="x", max_byte=4096, chunk_bytes=3, gid_index="")
        self.assertEqual(
            ["unknown setting 'fabric_' (did you mean fabric?): the settings are "
             + ", ".join(settings.keyword(v) for v in settings.SETTINGS) + ", or their ROCE_GATHER_ names",
             "unknown setting 'max_byte' (did you mean max_bytes?): the settings are "
             + ", ".join(settings.keyword(v) for v in settings.SETTINGS) + ", or their ROCE_GATHER_ names",
             'ROCE_GATHER_CHUNK_BYTES="3" is not a multiple of 4096 bytes from 4096 to 16777216',
             'ROCE_GATHER_GID_INDEX="" is empty (the library would ignore it)',
             'ROCE_GATHER_FABRIC="ib" (from the environment) is not auto, verbs or tcp'],
            str(cm.exception).splitlines())

    def test_a_retired_variable_stops_the_job_with_what_to_do_instead(self):
        with self.assertRaises(ValueError) as cm:
            job_env({"ROCE_GATHER_NET": "1", "ROCE_GATHER_PLACEMENT": ""}, mode="eager")
        self.assertEqual(
            ['ROCE_GATHER_MODE="eager" is retired with the CollNet route and changes nothing: unset it',
             "ROCE_GATHER_NET (from the environment) is retired with the CollNet route and changes nothing: "
             "unset it, and NCCL_NET=roce_gather and NCCL_COLLNET_ENABLE=1 with it: NCCL's own transports carry "
             "NCCL's traffic"],
            str(cm.exception).splitlines())

    def test_an_unknown_keyword_without_a_near_one_is_refused(self):
        with self.assertRaises(ValueError) as cm:
            job_env(nccl_net="roce_gather")
        self.assertTrue(str(cm.exception).startswith("unknown setting 'nccl_net': the settings are enable, "),
                        str(cm.exception))

    def test_a_keyword_replaces_a_bad_value_of_the_environment(self):
        env = job_env({"ROCE_GATHER_FABRIC": "ib"}, fabric="tcp")
        self.assertEqual("tcp", env["ROCE_GATHER_FABRIC"])

    def test_good_values_of_the_environment_stay_where_they_are(self):
        env = job_env({"ROCE_GATHER_MAX_BYTES": "128K", "ROCE_GATHER_STATS": "/tmp/s-%p.json", "ROCE_GATHER_FABRIC": ""})
        self.assertEqual(["NCCL_NET_PLUGIN", "NCCL_NET_PLUGIN_REF_COUNT"], list(env))

    def test_a_variable_of_the_environment_the_library_does_not_read_is_refused(self):
        with self.assertRaises(ValueError) as cm:
            job_env({"ROCE_GATHER_MAXBYTES": "128K"})
        self.assertTrue(str(cm.exception).startswith(
            "ROCE_GATHER_MAXBYTES is set in the environment, and the library reads no such variable "
            "(it reads ROCE_GATHER_ENABLE, "), str(cm.exception))

    def test_bool_stands_for_1_or_0_only_where_a_variable_is_0_or_1(self):
        with self.assertRaises(TypeError) as cm:
            job_env(max_bytes=True)
        self.assertEqual("ROCE_GATHER_MAX_BYTES=True: True or False stands for 1 or 0, and "
                         "ROCE_GATHER_MAX_BYTES is not 0 or 1", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            job_env(max_bytes=1.5e5)
        self.assertEqual("ROCE_GATHER_MAX_BYTES=150000.0: a setting is a string or an integer, not float",
                         str(cm.exception))

    def test_another_plugin_in_nccl_net_plugin_is_refused(self):
        with self.assertRaises(ValueError) as cm:
            job_env({"NCCL_NET_PLUGIN": "/opt/other/libnccl-net.so"})
        self.assertEqual('NCCL_NET_PLUGIN="/opt/other/libnccl-net.so" is already set to another plugin than '
                         + LIB + "; unset it to load roce_gather", str(cm.exception))
        with self.assertRaises(ValueError):
            job_env({"NCCL_NET_PLUGIN": "ib"})

    def test_this_plugin_in_nccl_net_plugin_becomes_its_path(self):
        for value in ("roce_gather", LIB, os.path.join(os.path.dirname(LIB), "libnccl-net-roce_gather.so")):
            self.assertEqual(LIB, job_env({"NCCL_NET_PLUGIN": value})["NCCL_NET_PLUGIN"], value)


class FakePackage:
    """A copy of the package with stand-ins for the binaries: a library file, and a plugincheck
    that prints its arguments and exits with $STUB_EXIT."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="roce_gather-test-")
        pkg = os.path.join(self.root, "roce_gather")
        shutil.copytree(os.path.join(HERE, "roce_gather"), pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
        os.makedirs(os.path.join(pkg, "lib"))
        os.makedirs(os.path.join(pkg, "bin"))
        self.lib = os.path.join(pkg, "lib", "libroce_gather.so")
        with open(self.lib, "wb") as f:
            f.write(b"\x7fELF stand-in")
        stub = os.path.join(pkg, "bin", "plugincheck")
        with open(stub, "w") as f:
            f.write('#!/bin/sh\necho "plugincheck $*"\nexit "${STUB_EXIT:-0}"\n')
        os.chmod(stub, 0o755)

    def run(self, *args, env=None):
        e = {k: v for k, v in os.environ.items()
             if not k.startswith("ROCE_GATHER_") and not k.startswith("NCCL_")}
        e.update(PYTHONPATH=self.root, PYTHONDONTWRITEBYTECODE="1")
        e.update(env or {})
        p = subprocess.run([sys.executable] + list(args), env=e, cwd=self.root,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        return p.returncode, p.stdout, p.stderr

    def close(self):
        shutil.rmtree(self.root)


class CommandTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pkg = FakePackage()

    @classmethod
    def tearDownClass(cls):
        cls.pkg.close()

    def test_env_prints_export_lines(self):
        code, out, err = self.pkg.run("-m", "roce_gather", "env", "max_bytes=256K", "ROCE_GATHER_STATS=/tmp/a b-%p")
        self.assertEqual((0, ""), (code, err))
        self.assertEqual(["export NCCL_NET_PLUGIN=" + self.pkg.lib,
                          "export NCCL_NET_PLUGIN_REF_COUNT=1",
                          "export ROCE_GATHER_MAX_BYTES=256K",
                          "export ROCE_GATHER_STATS='/tmp/a b-%p'"],
                         out.splitlines())

    def test_env_lines_set_the_variables_in_a_shell(self):
        code, out, _ = self.pkg.run("-m", "roce_gather", "env", "stats=/tmp/a b-%p")
        self.assertEqual(0, code)
        shown = subprocess.check_output(
            ["sh", "-c", out + 'printf "%s|%s|%s" "$NCCL_NET_PLUGIN" "$NCCL_NET_PLUGIN_REF_COUNT" "$ROCE_GATHER_STATS"'],
            universal_newlines=True)
        self.assertEqual(self.pkg.lib + "|1|/tmp/a b-%p", shown)

    def test_env_refuses_with_one_line_a_problem_and_exit_2(self):
        code, out, err = self.pkg.run("-m", "roce_gather", "env", "max_bytes=65M", "fabric=fast")
        self.assertEqual((2, ""), (code, out))
        self.assertEqual('roce_gather env: ROCE_GATHER_MAX_BYTES="65M" is outside 1..67108864\n'
                         'roce_gather env: ROCE_GATHER_FABRIC="fast" is not auto, verbs or tcp\n', err)
        code, out, err = self.pkg.run("-m", "roce_gather", "env", "max_bytes")
        self.assertEqual((2, "", "roce_gather env: 'max_bytes' is not NAME=VALUE\n"), (code, out, err))
        code, _, err = self.pkg.run("-m", "roce_gather", "env", "environ=1")
        self.assertEqual(2, code)
        self.assertTrue(err.startswith("roce_gather env: unknown setting 'environ'"), err)

    def test_env_checks_the_environment_it_runs_in(self):
        code, _, err = self.pkg.run("-m", "roce_gather", "env", env={"ROCE_GATHER_FABRIC": "gpu"})
        self.assertEqual((2, 'roce_gather env: ROCE_GATHER_FABRIC="gpu" (from the environment) is not auto, verbs or tcp\n'),
                         (code, err))

    def test_check_runs_plugincheck_abi_with_the_flags_and_returns_its_status(self):
        self.assertEqual((0, "plugincheck abi\n", ""), self.pkg.run("-m", "roce_gather", "check"))
        self.assertEqual((3, "plugincheck abi --json\n", ""),
                         self.pkg.run("-m", "roce_gather", "check", "--json", env={"STUB_EXIT": "3"}))

    def test_plugincheck_passes_every_argument(self):
        self.assertEqual((0, "plugincheck selftest --fabric tcp\n", ""),
                         self.pkg.run("-m", "roce_gather", "plugincheck", "selftest", "--fabric", "tcp"))

    def test_usage_and_unknown_commands(self):
        code, out, err = self.pkg.run("-m", "roce_gather")
        self.assertEqual((2, ""), (code, err))
        self.assertTrue(out.startswith("usage: python -m roce_gather <command>"), out)
        self.assertEqual(0, self.pkg.run("-m", "roce_gather", "--help")[0])
        code, out, err = self.pkg.run("-m", "roce_gather", "chek")
        self.assertEqual((2, ""), (code, out))
        self.assertTrue(err.startswith("roce_gather: unknown command 'chek'\n\nusage:"), err)

    def test_set_env_reaches_the_c_environment_nccl_reads(self):
        code, out, err = self.pkg.run("-c", """
import ctypes, roce_gather
env = roce_gather.set_env(max_bytes=4096)
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
print(" ".join(getenv(v.encode()).decode() for v in env))
""")
        self.assertEqual((0, ""), (code, err))
        self.assertEqual(self.pkg.lib + " 1 4096\n", out)

    def test_a_refused_set_env_sets_nothing(self):
        code, out, err = self.pkg.run("-c", """
import os, roce_gather
try:
    roce_gather.set_env(max_bytes=4096, fabric="fast")
except ValueError as e:
    print(e)
print(sorted(k for k in os.environ if k.startswith(("NCCL_", "ROCE_GATHER_"))))
""")
        self.assertEqual((0, ""), (code, err))
        self.assertEqual('ROCE_GATHER_FABRIC="fast" is not auto, verbs or tcp\n[]\n', out)

    def test_the_paths_are_the_packaged_files(self):
        code, out, err = self.pkg.run("-c", "import roce_gather as r; print(r.library_path()); print(r.library_dir()); "
                                            "print(r.plugincheck_path())")
        self.assertEqual((0, ""), (code, err))
        self.assertEqual([self.pkg.lib, os.path.dirname(self.pkg.lib),
                          os.path.join(self.pkg.root, "roce_gather", "bin", "plugincheck")], out.splitlines())


class SourceTreeTest(unittest.TestCase):
    def test_without_the_binaries_the_paths_say_where_they_come_from(self):
        with self.assertRaises(FileNotFoundError) as cm:
            roce_gather.library_path()
        self.assertEqual(os.path.join(HERE, "roce_gather", "lib", "libroce_gather.so")
                         + " is missing: roce_gather's binaries come in its wheel (make wheel builds it)",
                         str(cm.exception))


if __name__ == "__main__":
    unittest.main()
