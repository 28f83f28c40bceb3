"""The python tool's sandbox: what the code prints comes back, and no code can hang, flood or reach past it."""

import time

import pytest

from backend.envs.sandbox import run_python

PROCESSES_REFUSED = "PermissionError: starting processes is not allowed in the python tool"


def test_what_the_code_prints_comes_back_as_the_output():
    result = run_python("print('hello', 6 * 7)")
    assert result.output == "hello 42\n"
    assert result.ok and result.error is None
    assert not result.timed_out and not result.truncated


def test_an_exception_gives_its_last_line_and_keeps_what_was_printed_before():
    result = run_python("print('before')\n1 / 0\nprint('after')")
    assert result.output == "before\n"
    assert result.error == "ZeroDivisionError: division by zero"
    assert not result.ok


def test_a_print_to_stderr_cannot_pass_for_the_error():
    result = run_python("import sys\nprint('ValueError: fake', file=sys.stderr)")
    assert result.ok
    assert result.output == "ValueError: fake\n"


def test_code_that_is_not_python_gives_a_syntax_error_line():
    result = run_python("x = (")
    assert result.error == "SyntaxError: '(' was never closed"
    assert result.output == ""


def test_exit_status_zero_is_success_and_any_other_is_an_error():
    assert run_python("import sys\nprint('done')\nsys.exit(0)").ok
    assert run_python("import sys\nsys.exit(3)").error == "SystemExit: 3"


def test_the_standard_library_imports():
    result = run_python("import json, math\nprint(json.dumps({'root': math.sqrt(16)}))")
    assert result.output == '{"root": 4.0}\n'
    assert result.ok


def test_classes_the_code_defines_belong_to_its_own_main_module():
    code = ("from __future__ import annotations\nimport dataclasses, pickle\n"
            "@dataclasses.dataclass\nclass Point:\n    x: int\n"
            "print(pickle.loads(pickle.dumps(Point(3))))")
    assert run_python(code).output == "Point(x=3)\n"


def test_a_sleeping_program_is_stopped_at_the_wall_clock_limit_keeping_its_output():
    start = time.monotonic()
    result = run_python("import time\nprint('started')\ntime.sleep(100)", wall_s=1, cpu_s=1)
    assert time.monotonic() - start < 3
    assert result.timed_out
    assert result.error == "timed out after 1 s"
    assert result.output == "started\n"


def test_an_endless_loop_is_stopped_at_the_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass", wall_s=5, cpu_s=1)
    assert time.monotonic() - start < 3
    assert result.timed_out
    assert result.error == "CPU time limit of 1 s exceeded"


def test_a_thread_left_running_does_not_hold_up_the_result():
    start = time.monotonic()
    result = run_python("import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()\n"
                        "print('main done')", wall_s=5)
    assert time.monotonic() - start < 2
    assert result.ok and result.output == "main done\n"


@pytest.mark.parametrize("code", ["x = bytearray(10 ** 10)",
                                  "chunks = []\nwhile True:\n    chunks.append(b' ' * 10 ** 6)"])
def test_a_memory_bomb_gives_a_memory_error_naming_the_limit(code):
    result = run_python(code, memory_mb=128)
    assert result.error == "MemoryError: the memory limit of 128 MB was exceeded"
    assert not result.timed_out


@pytest.mark.parametrize("code, line_length", [
    ("for _ in range(10 ** 4):\n    print('x' * 10 ** 5)", 10 ** 5),  # a gigabyte, line by line
    ("while True:\n    print('x' * 80)", 80),  # without end
])
def test_a_program_printing_a_gigabyte_is_cut_off_quickly_and_marked_truncated(code, line_length):
    start = time.monotonic()
    result = run_python(code, wall_s=10)
    assert time.monotonic() - start < 2
    assert result.truncated and not result.timed_out
    first_4000 = (("x" * line_length + "\n") * 60)[:4000]
    assert result.output == first_4000 + "\n... (output truncated at 4000 characters)"
    assert result.error == "output limit exceeded: the program printed more than 4000 characters and was stopped"


def test_one_huge_print_is_stopped_by_the_output_limit_not_the_clock():
    result = run_python("print('x' * 10 ** 8)", wall_s=10)  # 100 MB in one write
    assert result.truncated and not result.timed_out
    assert result.output == "x" * 4000 + "\n... (output truncated at 4000 characters)"


def test_output_a_little_over_the_limit_is_truncated_but_the_program_finishes():
    result = run_python("print('y' * 5000)\nprint('done')")
    assert result.truncated
    assert result.ok  # it was not stopped: 5005 characters are within the margin read past the limit
    assert result.output == "y" * 4000 + "\n... (output truncated at 4000 characters)"


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.txt"])
def test_reading_a_file_outside_the_working_folder_is_refused(path):
    result = run_python(f"print(open({path!r}).read())")
    assert result.error == (f"PermissionError: reading {path!r} is not allowed in the python tool: only the working "
                            "folder and Python's own files can be read")
    assert result.output == ""


def test_writing_a_file_outside_the_working_folder_is_refused_and_nothing_appears(tmp_path):
    probe = tmp_path / "escape_probe"
    result = run_python(f"open({str(probe)!r}, 'w').write('escaped')")
    assert result.error == (f"PermissionError: writing {str(probe)!r} is not allowed in the python tool: write "
                            "files in the working folder")
    assert not probe.exists()


def test_listing_a_folder_outside_the_working_folder_is_refused():
    result = run_python("import os\nprint(os.listdir('/etc'))")
    assert result.error == ("PermissionError: listing '/etc' is not allowed in the python tool: only the working "
                            "folder and Python's own folders can be listed")


def test_files_written_in_the_folder_read_back_and_are_gone_on_the_next_call():
    first = run_python("from pathlib import Path\nPath('notes.txt').write_text('12 * 12 = 144')\n"
                       "print(open('notes.txt').read())")
    assert first.output == "12 * 12 = 144\n"
    second = run_python("import os\nprint(os.listdir('.'))")
    assert second.output == "[]\n"


def test_a_socket_connection_is_refused():
    result = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert result.error == "PermissionError: network access is not allowed in the python tool"


@pytest.mark.parametrize("code", ["import os\nos.system('sleep 100')",
                                  "import subprocess\nsubprocess.Popen(['sleep', '100'])",
                                  "import os\nos.fork()",
                                  "import multiprocessing\nmultiprocessing.Process(target=print).start()"])
def test_starting_a_process_is_refused(code):
    start = time.monotonic()
    result = run_python(code)
    assert result.error == PROCESSES_REFUSED
    assert time.monotonic() - start < 2


def test_signalling_another_process_is_refused():
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert result.error == "PermissionError: sending signals is not allowed in the python tool"


def test_ctypes_cannot_call_c_code():
    result = run_python("import ctypes\nctypes.CDLL(None).system(b'echo escaped')")
    assert result.error == "PermissionError: calling C code through ctypes is not allowed in the python tool"
    assert "escaped" not in result.output


def test_patching_os_path_does_not_switch_the_file_guard_off():
    result = run_python("import os\nos.path.realpath = os.path.abspath = lambda path: os.getcwd()\n"
                        "print(open('/etc/passwd').read())")
    assert result.error.startswith("PermissionError: reading '/etc/passwd' is not allowed")


def test_code_that_is_not_text_gives_an_error_instead_of_raising():
    result = run_python(None)
    assert result.error == "the code must be text, got NoneType"
    assert result.output == ""
