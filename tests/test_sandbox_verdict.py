"""Assert tests whose verdict the tested program cannot forge (issue 31).

Every forging program below knows nothing about the answers: it attacks the harness (frames, ``gc``,
``/proc/self/mem``, file descriptors, the encoder, exits) or the comparison (objects that equal
everything). Each must score 0 on tests an honest solution passes.
"""

import json
import textwrap
import time

import pytest

from jaxrl.rewards import assert_check
from jaxrl.rewards.assert_check import UnsupportedTest, decode, encode, plan
from jaxrl.rewards.sandbox import SandboxLimits, run_tests

FAST = SandboxLimits(wall_time_s=3.0, cpu_time_s=2.0)
SECRET = 79197919  # an answer the program cannot guess; it appears only in the tests below
TESTS = [
    {"assert": f"assert f(2) == {SECRET}"},
    {"assert": f"assert f(3) == {SECRET + 1}"},
    {"assert": f"x = f(5)\nassert x == {SECRET + 3}, x"},
]
HONEST = f"def f(x):\n    return {SECRET} + x - 2\n"

# Writes a framed message (4-byte length + JSON) to every fd it can: replies the harness would send.
_SPRAY = r'''
import json, os
def _frame(obj):
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "big") + data
def spray():
    fake = b"".join(_frame(m) for m in (["ready"], *(["ok", True] for _ in range(8))))
    for fd in range(0, 256):
        try:
            os.write(fd, fake)
        except OSError:
            pass
'''

FORGERS = {
    # the original forgery: the nonce and marker fd from the calling frame
    "caller_frame": "import sys, os\nloc = sys._getframe(1).f_locals\n"
                    "os.write(loc['marker_fd'], loc['nonce'])\nos._exit(0)\n",
    "current_frames": textwrap.dedent("""
        import sys, os
        for fr in list(sys._current_frames().values()):
            while fr is not None:
                loc = fr.f_locals
                if 'nonce' in loc and 'marker_fd' in loc:
                    os.write(loc['marker_fd'], loc['nonce'])
                    os._exit(0)
                fr = fr.f_back
        """),
    # the new harness's own fds, found in its frame: answer "True" to everything, then leave
    "frame_reply_fd": _SPRAY + textwrap.dedent("""
        import sys
        loc = sys._getframe(1).f_locals
        fd = loc.get('reply_fd', 1)
        os.write(fd, _frame(['ready']) + b''.join(_frame(['ok', True]) for _ in range(8)))
        os._exit(0)
        """),
    "spray_fds_and_exit": _SPRAY + "spray()\nos._exit(0)\n",
    "spray_fds_in_f": _SPRAY + "def f(x):\n    spray()\n    os._exit(0)\n",
    "eq_always_true": "class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                      "def f(x):\n    return A()\n",
    "ne_bool_always": "class A:\n    def __eq__(self, o):\n        return True\n"
                      "    def __ne__(self, o):\n        return False\n    def __bool__(self):\n        return True\n"
                      "def f(x):\n    return A()\n",
    "int_subclass": "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                    "def f(x):\n    return I(0)\n",
    "str_subclass": "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
                    "def f(x):\n    return S('')\n",
    "list_subclass": "class L(list):\n    def __eq__(self, o):\n        return True\n"
                     "def f(x):\n    return L()\n",
    "list_holding_object": "class A:\n    def __eq__(self, o):\n        return True\n"
                           "def f(x):\n    return [A()]\n",
    # replace the harness's encoder: everything is sent as ``true``
    "patched_encoder": "import sys\ng = sys._getframe(1).f_globals\n"
                       "g['encode'] = lambda *a, **k: 'true'\n"
                       "def f(x):\n    return object()\n",
    "os_exit": "import os\nos._exit(0)\n",
    "sys_exit": "import sys\nsys.exit(0)\n",
    "exit_in_f": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "os_exit_in_f": "import os\ndef f(x):\n    os._exit(0)\n",
    "atexit": _SPRAY + "import atexit\natexit.register(spray)\ndef f(x):\n    raise SystemExit(0)\n",
    "thread_spray": _SPRAY + "import threading, time\n"
                    "threading.Thread(target=lambda: [spray() or time.sleep(0.01) for _ in range(50)],"
                    " daemon=True).start()\n"
                    "def f(x):\n    time.sleep(0.3)\n    return None\n",
    # the old harness's "check" code object, found with gc: run it with a fake namespace
    "gc_referrers": textwrap.dedent("""
        import gc, os, sys
        def f(x):
            for obj in gc.get_objects():
                if isinstance(obj, dict) and ('nonce' in obj or 'marker_fd' in obj):
                    os.write(obj['marker_fd'], obj['nonce'])
                    os._exit(0)
            for ref in gc.get_referrers(sys._getframe()):
                pass
            return None
        """),
}


@pytest.mark.parametrize("code", FORGERS.values(), ids=FORGERS.keys())
def test_forging_programs_score_zero(code):
    result = run_tests(code, TESTS, FAST)
    assert result.pass_fraction == 0.0, result
    assert not any(c.status == "ok" for c in result.cases), result


def test_honest_solution_scores_one_on_the_same_tests():
    result = run_tests(HONEST, TESTS, FAST)
    assert result.pass_fraction == 1.0, result


# A program that finds the expected answer anywhere in its process (memory, objects, frames, fds)
# returns it. The answer must not be there: the comparison happens in the caller.
LEAK_HUNTERS = {
    # strings holding "f(2) == <n>" or code objects holding a large int constant (the compiled test)
    "gc_and_frames": textwrap.dedent("""
        import gc, re, sys
        PATTERN = re.compile(r"f\\(2\\) == (\\d+)")
        def hunt():
            pool = list(gc.get_objects())
            for fr in sys._current_frames().values():
                while fr is not None:
                    pool += [*fr.f_locals.values(), fr.f_code]
                    fr = fr.f_back
            for obj in pool:
                if isinstance(obj, bytes):
                    obj = obj.decode('utf-8', 'replace')
                if isinstance(obj, str) and PATTERN.search(obj):
                    return int(PATTERN.search(obj).group(1))
                if type(obj).__name__ == 'code':
                    for c in obj.co_consts:
                        if type(c) is int and 10 ** 7 < c < 10 ** 9:
                            return c
            return None
        def f(x):
            return hunt()
        """),
    "proc_self_mem": textwrap.dedent("""
        import re
        PATTERN = re.compile(rb"f\\(2\\) == (\\d+)")
        def f(x):
            with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
                for line in maps:
                    m = re.match(r'([0-9a-f]+)-([0-9a-f]+) r', line)
                    if not m:
                        continue
                    lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                    if hi - lo > 64 << 20:
                        continue
                    try:
                        mem.seek(lo)
                        found = PATTERN.search(mem.read(hi - lo))
                    except (OSError, ValueError, OverflowError):
                        continue
                    if found:
                        return int(found.group(1))
            return None
        """),
    "read_fds": textwrap.dedent("""
        import os, re
        PATTERN = re.compile(rb"f\\(2\\) == (\\d+)")
        def f(x):
            for fd in range(0, 256):
                try:
                    os.set_blocking(fd, False)
                    os.lseek(fd, 0, 0)
                except OSError:
                    pass
                try:
                    found = PATTERN.search(os.read(fd, 1 << 20))
                except OSError:
                    continue
                if found:
                    return int(found.group(1))
            return None
        """),
}


@pytest.mark.parametrize("code", LEAK_HUNTERS.values(), ids=LEAK_HUNTERS.keys())
def test_the_answer_is_nowhere_in_the_programs_process(code):
    result = run_tests(code, [{"assert": f"assert f(2) == {SECRET}"}], FAST)
    assert result.pass_fraction == 0.0, result
    assert [c.status for c in result.cases] == ["wrong_answer"], result  # it ran, found nothing


def test_the_program_sees_only_program_side_code():
    p = plan(f"expected = [{SECRET}]\nassert all(f(x) == e for x, e in zip([2], expected)), expected")
    assert p.program_code == (("eval", "f(_jaxrl_a0)"),)
    assert str(SECRET) not in json.dumps(p.program_code)


# -- honest solutions of common test shapes still score 1 ------------------------------

SHAPES = [
    # (program, test): MBPP-style
    ("def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
     "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"),
    ("def is_not_prime(n):\n    return n != 2 and any(n % d == 0 for d in range(2, n))\n",
     "assert is_not_prime(2) == False"),
    ("import heapq\ndef heap_queue_largest(nums, n):\n    return heapq.nlargest(n, nums)\n",
     "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65]"),
    ("import math\ndef volume_cone(r, h):\n    return math.pi * r * r * h / 3\n",
     "assert math.isclose(volume_cone(5,12), 314.15926535897927, rel_tol=0.001)"),
    ("def find_char_long(s):\n    return [w for w in s.split() if len(w) >= 4]\n",
     "assert set(find_char_long('Please move back to stream')) == set(['Please', 'move', 'back', 'stream'])"),
    # float tolerance, comprehension, loops over cases, isinstance, exceptions, methods on objects
    ("def f(x):\n    return x ** 0.5\n", "assert abs(f(2) - 1.41421356) < 1e-6"),
    ("def f(x):\n    return x * x\n", "assert all(f(x) == x * x for x in range(5))"),
    ("def f(x):\n    return x * x\n", "cases = [(1, 1), (2, 4), (-3, 9)]\nfor a, b in cases:\n    assert f(a) == b, a"),
    ("def f(x):\n    return [x] * 2\n", "assert isinstance(f(1), list) and len(f(1)) == 2"),
    ("def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
     "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False, 'no error'"),
    ("class Solution:\n    def twoSum(self, nums, target):\n"
     "        seen = {}\n        for i, n in enumerate(nums):\n"
     "            if target - n in seen:\n                return [seen[target - n], i]\n            seen[n] = i\n",
     "assert Solution().twoSum([2,7,11,15], 9) == [0,1]"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n"
     "    def push(self, x):\n        self.items.append(x)\n    def top(self):\n        return self.items[-1]\n",
     "s = Stack()\ns.push(3)\ns.push(4)\nassert s.top() == 4"),
    ("def f(x):\n    return map(str, range(x))\n", "assert list(f(3)) == ['0', '1', '2']"),
    ("def f(x):\n    return {x: (x, 2.5, None, b'z', 1j, frozenset({1}))}\n",
     "assert f(1) == {1: (1, 2.5, None, b'z', 1j, frozenset({1}))}"),
    ("def f():\n    return float('nan'), 10 ** 5000\n", "a, b = f()\nassert a != a and b == 10 ** 5000"),
    # MBPP 40 and 367: a Counter compared with a dict; setup lines that build the program's objects
    ("from collections import Counter, deque\nfrom itertools import chain\n"
     "def freq_element(nums):\n    return Counter(chain.from_iterable(nums))\n"
     "def window(xs):\n    return deque(xs, maxlen=2)\n",
     "assert freq_element([[1, 2, 3, 2], [4, 5, 6, 2]])==({2: 3, 1: 1, 3: 1, 4: 1, 5: 1, 6: 1})\n"
     "assert window([1, 2, 3]) == [2, 3]"),
    ("class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n"
     "def height(n):\n    return 0 if n is None else 1 + max(height(n.left), height(n.right))\n",
     "root = Node(1) \r\nroot.left = Node(2) \r\nroot.left.left = Node(4)\r\nroot.left.left.data += 1\n"
     "assert height(root) == 3 and root.left.left.data == 5"),
    # HumanEval-style check(candidate); the second is HumanEval/32's test (setup in the program's
    # process, random inputs drawn by the checker)
    ("import math\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n"
     "def find_zero(xs):\n    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n"
     "        lo, hi = lo * 2, hi * 2\n    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n"
     "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n            hi = mid\n"
     "    return lo\n",
     "def check(candidate):\n    import math\n    import random\n    rng = random.Random(42)\n    import copy\n"
     "    for _ in range(30):\n        ncoeff = 2 * rng.randint(1, 4)\n        coeffs = []\n"
     "        for _ in range(ncoeff):\n            coeff = rng.randint(-10, 10)\n            if coeff == 0:\n"
     "                coeff = 1\n            coeffs.append(coeff)\n"
     "        solution = candidate(copy.deepcopy(coeffs))\n        assert math.fabs(poly(coeffs, solution)) < 1e-4\n"
     "\ncheck(find_zero)\n"),
    ("def truncate_number(x):\n    return x % 1.0\n",
     "METADATA = {'author': 'jt', 'dataset': 'test'}\n\n\ndef check(candidate):\n"
     "    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
     "    assert True, 'This prints if this assert fails'\n\ncheck(truncate_number)\n"),
]


@pytest.mark.parametrize("code, test", SHAPES, ids=[t[:40] for _, t in SHAPES])
def test_honest_solutions_of_common_shapes_pass(code, test):
    result = run_tests(code, [{"assert": test}], FAST)
    assert result.pass_fraction == 1.0, result
    wrong = run_tests("def _unused():\n    pass\n", [{"assert": test}], FAST)  # no solution: fails
    assert wrong.pass_fraction == 0.0, wrong


def test_statuses_of_failures():
    tests = [
        {"assert": "assert f(2) == 4"},  # wrong value
        {"assert": "assert g(2) == 4"},  # raises
        {"assert": "assert h(2) == 4"},  # not a plain value
        {"assert": "while True:\n    pass"},  # cannot be split: fails closed without running
        {"assert": "assert f(2) is f(2)"},  # `is` between values of the program
        {"assert": "g = lambda t: t\ntry:\n    assert f(g) == 5\nexcept Exception:\n    pass"},  # a lambda to send
    ]
    code = "def f(x):\n    return 5\ndef g(x):\n    raise KeyError(x)\ndef h(x):\n    return object()\n"
    result = run_tests(code, tests, FAST)
    assert [c.status for c in result.cases] == [
        "wrong_answer", "runtime_error", "bad_value", "unsupported_test", "unsupported_test", "unsupported_test"
    ], result


def test_replies_are_bounded():
    # junk, a huge length prefix, a flood, a too-large value, and colliding set keys (quadratic insert)
    junk = "import sys, os\nfd = sys._getframe(1).f_locals['reply_fd']\n"
    programs = {
        junk + "os.write(fd, b'\\x00\\x00\\x00\\x05junk!')\ndef f(x):\n    return 1\n": "bad_reply",
        junk + "os.write(fd, b'\\xff\\xff\\xff\\xff')\ndef f(x):\n    return 1\n": "bad_reply",
        junk + "import threading\n"
               "threading.Thread(target=lambda: [os.write(fd, b'x' * 65536) for _ in range(400)],"
               " daemon=True).start()\ndef f(x):\n    import time; time.sleep(1)\n": "bad_reply",
        "def f(x):\n    return 'x' * (2 << 20)\n": "bad_value",
        junk + "import json\nbad = json.dumps(['ok', {'s': [(2 ** 61 - 1) * k for k in range(1, 20000)]}])\n"
               "os.write(fd, b'\\x00\\x00\\x00\\x09[\"ready\"]' + len(bad).to_bytes(4, 'big') + bad.encode())\n"
               "def f(x):\n    os._exit(0)\n": "bad_reply",
    }
    start = time.monotonic()
    for code, status in programs.items():
        result = run_tests(code, [{"assert": "assert f(2) == 1"}], FAST)
        assert [c.status for c in result.cases] == [status], (code, result)
    colliding = "def f(x):\n    return [(2 ** 61 - 1) * k for k in range(1, 20000)]\n"
    result = run_tests(colliding, [{"assert": "assert len(set(f(2))) > 0"}], FAST)
    assert [c.status for c in result.cases] == ["bad_reply"], result  # refused as it is decoded
    spread = "def f(x):\n    return list(range(1, 20000))\n"  # collides only once the checker multiplies
    result = run_tests(spread, [{"assert": "assert len(set(k * (2 ** 61 - 1) for k in f(2))) > 0"}], FAST)
    assert [c.status for c in result.cases] == ["checker_limit"], result
    assert time.monotonic() - start < 15


def test_checker_guards_stop_runaway_checker_work():
    # the program's values may make checker-side code huge; it stops at a guard instead
    code = "def f(x):\n    return 10 ** 15\ndef g(x):\n    return ['x' * 1000] * 500 if x == 2 else 'y' * 10000\n"
    for test in ("assert len([0] * f(1)) > 0", "assert sum(range(f(1))) > 0", "assert 2 ** f(1) > 0",
                 "assert all(True for _ in range(f(1)))", "assert len(set(range(f(1)))) > 0",
                 "assert pow(3, f(1) ** 400, f(1) ** 400 + 1) > 0", "assert (1 << f(1)) > 0",
                 "assert len(str(g(1)).join(g(2))) > 0", "assert sum(g(3), []) == []",
                 "assert len([[0] * (f(1) // 10 ** 9) for _ in range(100)]) > 0",
                 "assert round(f(1), -f(1)) == 0"):
        start = time.monotonic()
        result = run_tests(code, [{"assert": test}], FAST)
        assert [c.status for c in result.cases] == ["checker_limit"], (test, result)
        assert time.monotonic() - start < 3, test


# -- the split and the codec, without a sandbox ----------------------------------------

def test_plan_splits_and_refuses():
    assert plan("assert f(2) == 4").program_code == (("eval", "f(2)"),)
    assert plan("assert math.isclose(area(2), 12.56)").program_code == (("eval", "area(2)"),)
    assert plan("import os\nassert os.getcwd()").program_code == (("exec", "import os"), ("eval", "os.getcwd()"))
    for test in ("x = 1\nwhile x:\n    pass", "assert (y := f(1))", "assert sorted.__self__",
                 "def g():\n    pass", "assert f(1) is f(1)", "x = f(1)\nx = 2", "_jaxrl_ask = 1",
                 "with open('x'):\n    pass", "assert ''.format(1)", "try:\n    f()\nexcept:\n    pass"):
        with pytest.raises(UnsupportedTest):
            plan(test)


def test_codec_round_trips_plain_values_and_refuses_the_rest():
    values = [None, True, 0, -5, 10**4000, 2.5, -0.0, 1e300, float("inf"), 1 + 2j, "é\n\x00\x7f\"\\\ud800🙂",
              b"\x00", [1, [2]], (1, (2,)), {1, 2}, frozenset({3}), {"a": [1], (1, 2): None}, [[]]]
    for v in values:
        back = decode(encode(v))
        assert back == v and type(back) is type(v), v
        assert repr(back) == repr(v)  # -0.0, exact floats
    assert list(decode(encode(map(str, range(3))))) == ["0", "1", "2"]
    assert list(decode(encode(range(2)))) == [0, 1]
    nan = decode(encode(float("nan")))
    assert nan != nan
    class Int(int):
        pass
    for v in (Int(1), [Int(1)], {"k": object()}, print, type, [[]] * 0 + [[[]]] and _nested(200)):
        with pytest.raises(TypeError):
            encode(v)
    for data in ('{"a": 1}', '{"t": 1}', '[' * 100000, '{"s": [[1]]}', "x" * (2 << 20), '{"Z": []}',
                 "[" * 150 + "]" * 150):
        with pytest.raises(ValueError):
            decode(data)


def _nested(depth):
    v = []
    for _ in range(depth):
        v = [v]
    return v


def test_program_exceptions_are_not_the_checkers():
    e = assert_check.program_exception("SystemExit", (0,))
    assert not isinstance(e, Exception)  # a test's `except Exception` does not catch it
    e = assert_check.program_exception("PermissionError", (1, "Operation not permitted"))
    assert isinstance(e, OSError) and e.errno == 1 and e.from_program
    e = assert_check.program_exception("StopIteration", ())  # would end map() early inside all(...)
    assert not isinstance(e, Exception)
    e = assert_check.program_exception("ExceptionGroup", ("x", [1]))  # cannot be built from plain values
    assert not isinstance(e, Exception)


def test_lambdas_and_loop_variables_inside_program_side_code():
    code = "def apply(fn, xs):\n    return [fn(x) for x in xs]\n"
    tests = [
        {"assert": "k = 3\nassert apply(lambda t: t + k, [1, 2]) == [4, 5]"},
        {"assert": "assert all(apply(lambda t: t * n, [1]) == [n] for n in range(3))"},
        {"assert": "assert apply(lambda t: [t for _ in range(2)], [7]) == [[7, 7]]"},
    ]
    assert plan(tests[0]["assert"]).program_code == (("eval", "apply(lambda t: t + _jaxrl_a0, [1, 2])"),)
    result = run_tests(code, tests, FAST)
    assert result.pass_fraction == 1.0, result


def test_stop_iteration_from_the_program_does_not_end_checker_iteration():
    # all(map(...)) is True if map() ends early: a StopIteration raised by f must not end it
    code = "def f(x):\n    raise StopIteration\n"
    tests = [{"assert": f"assert all(map(lambda x: f(x) == {SECRET}, range(3)))"},
             {"assert": f"assert all([f(x) == {SECRET} for x in range(3)])"},
             {"assert": "try:\n    f(1)\nexcept Exception:\n    pass"}]
    result = run_tests(code, tests, FAST)
    assert [c.status for c in result.cases] == ["runtime_error"] * 3, result


def test_test_inputs_drawn_at_random_are_the_checkers():
    # HumanEval/53's shape: the inputs come from `random` in the test. They must be drawn by the checker
    # and sent, not drawn in the program's process, which could report any x and y it likes.
    test = textwrap.dedent("""
        import random
        from string import ascii_lowercase
        def check(candidate):
            assert candidate(0, 1) == 1
            for i in range(20):
                x, y = random.randint(0, 1000), random.randint(0, 1000)
                assert candidate(x, y) == x + y
            rng = random.Random(7)
            s = ''.join(rng.choice(ascii_lowercase) for _ in range(5))
            assert candidate(s, '!') == s + '!'
        check(add)
        """)
    assert [mode for mode, _ in plan(test).program_code] == ["eval"] * 3
    honest = run_tests("def add(x, y):\n    return x + y\n", [{"assert": test}], FAST)
    assert honest.pass_fraction == 1.0, honest
    # claims x = y = 0 and add(x, y) = 0 whatever it is asked: only its own answers are in its hands
    liar = ("import random\nrandom.randint = lambda a, b: 0\n"
            "random.Random = lambda seed: type('R', (), {'choice': lambda self, seq: ''})()\n"
            "def add(x, y):\n    return y if not x else 0\n")
    assert run_tests(liar, [{"assert": test}], FAST).pass_fraction == 0.0


def test_methods_whose_argument_is_the_answer_run_in_the_checker():
    test = {"assert": f"assert f(2).startswith('{SECRET}') and f(3).issubset({{{SECRET}}})"}
    assert plan(test["assert"]).program_code == (("eval", "f(2)"), ("eval", "f(3)"))
    forger = ("class Yes:\n    def __getattr__(self, name):\n        return lambda *a: True\n"
              "def f(x):\n    return Yes()\n")
    result = run_tests(forger, [test], FAST)
    assert [c.status for c in result.cases] == ["bad_value"], result
    honest = f"def f(x):\n    return '{SECRET}!' if x == 2 else {{{SECRET}}}\n"
    assert run_tests(honest, [test], FAST).pass_fraction == 1.0
    views = {"assert": "assert f(1).keys() == {'a'} and sorted(f(1).items()) == [('a', 2)]"}
    assert run_tests("def f(x):\n    return {'a': 2}\n", [views], FAST).pass_fraction == 1.0


def test_an_unsupported_test_is_logged_once(monkeypatch, caplog):
    import logging

    import jaxrl.rewards.sandbox as sandbox
    monkeypatch.setattr(sandbox, "_unsupported_warned", False)
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        result = run_tests(HONEST, [{"assert": "while True:\n    pass"}] * 2, FAST)
    assert [c.status for c in result.cases] == ["unsupported_test"] * 2
    assert caplog.text.count("cannot be judged safely") == 1 and "While" in caplog.text


def test_a_task_to_write_a_builtin_is_the_programs_only_where_the_test_calls_nothing_else():
    # MBPP 126: the task is to write `sum(a, b)` (the sum of common divisors); the test calls it
    code = "def sum(a, b):\n    return __builtins__.sum(i for i in range(1, min(a, b)) if a % i == 0 == b % i)\n"
    assert run_tests(code, [{"assert": "assert sum(10,15) == 6"}], FAST).pass_fraction == 1.0
    assert run_tests("x = 1\n", [{"assert": "assert sum(10,15) == 6"}], FAST).pass_fraction == 0.0
    # but where the test also calls the program, `sorted` of the expected value stays the checker's:
    # the program's `sorted` would see [3, 1, 2] and could answer whatever its f said
    forger = "def f(x):\n    return [0]\ndef sorted(xs, **k):\n    return [0]\n"
    test = {"assert": "assert sorted(f(3)) == sorted([3, 1, 2])"}
    assert run_tests(forger, [test], FAST).pass_fraction == 0.0
    assert assert_check.shadowed_builtins(forger) == {"sorted"}
    assert assert_check.shadowed_builtins("def g():\n    def sum(): pass\nlen = 3\nmax == 2\n") == {"len"}
