"""Programming requests (CodeUltraFeedback-like): a task, sometimes a snippet, and requirements.

Each topic has its own language, vocabulary and kind of snippet, so prompts on one
topic sit together in embedding space. Harder tasks add constraints (complexity,
concurrency, edge cases, tests) and longer pasted code.
"""

from __future__ import annotations

from .common import EASY, HARD, MEDIUM, Dice, deck, fill, voice

KIND = "code"

_NOUNS = ("user", "order", "invoice", "sensor", "ticket", "product", "message", "session", "payment", "event",
          "employee", "booking", "device", "article", "comment")


def _noun(d: Dice) -> str:
    return d.pick(_NOUNS)


# --- tasks per topic: (easy, medium, hard) lists of callables returning a sentence ----------------

def _python(d: Dice, level: int) -> str:
    n = _noun(d)
    return d.by_level(level, (
        "Write a Python function that reverses every word in a sentence but keeps the word order.",
        "How do I remove duplicates from a list in Python while keeping the original order?",
        f"Write a Python function that counts how often each {n} id appears in a list.",
        "What's the simplest way to read a text file line by line in Python?",
    ), (
        f"Write a Python class `{n.capitalize()}Store` that keeps {n}s in memory and supports add, get by id and "
        "delete.",
        f"Write a Python function that flattens an arbitrarily nested list of {n} records into one list.",
        f"Write a Python generator that yields the {n}s from a large CSV file in chunks of {d.between(2, 20) * 50}.",
        f"Implement a Python decorator that retries a function up to {d.between(3, 6)} times with exponential backoff.",
    ), (
        "Implement an LRU cache in Python from scratch (no functools) with O(1) get and put, and make it thread-safe.",
        f"Write a Python library function that merges overlapping time intervals of {n} bookings; it must run in "
        "O(n log n) and handle open-ended intervals.",
        f"Design a Python plugin system where {n} handlers are discovered at import time, ordered by priority, and can "
        "be hot-reloaded without leaking memory.",
    ))


def _sql(d: Dice, level: int) -> str:
    n = _noun(d)
    return d.by_level(level, (
        f"Write a SQL query that returns all {n}s created in the last 7 days.",
        f"How do I count the rows in the `{n}s` table grouped by status in PostgreSQL?",
        f"Write a SQL query to find the 10 most recent {n}s.",
    ), (
        f"Write a SQL query that returns each customer's total spend and their most recent {n}, using tables "
        f"`customers` and `{n}s`.",
        f"In MySQL, how can I find duplicate {n} rows that share the same email and keep only the oldest one?",
        f"Write a PostgreSQL query that computes a 7-day rolling average of daily {n} counts.",
    ), (
        f"Our PostgreSQL query joining `{n}s` (40M rows) to `customers` takes 30 seconds. Explain how to read the "
        "EXPLAIN ANALYZE output, which indexes to add, and rewrite the query to use a window function instead of a "
        "correlated subquery.",
        f"Design a schema for a multi-tenant {n} tracking system with soft deletes, audit history and row-level "
        "security, and write the migration SQL.",
    ))


def _javascript(d: Dice, level: int) -> str:
    n = _noun(d)
    return d.by_level(level, (
        "How do I add a click event listener to a button in JavaScript?",
        "Write a JavaScript function that formats a date as YYYY-MM-DD.",
        "How do I center a div horizontally and vertically with CSS?",
    ), (
        f"Write a React component that fetches a list of {n}s from `/api/{n}s` and shows them in a table with a "
        "loading state.",
        "Write a debounced search box in vanilla JavaScript that calls an API after the user stops typing for 300 ms.",
        f"Convert this callback-based Node.js code that reads {n} files to async/await.",
    ), (
        f"Build a React hook `use{n.capitalize()}Stream` that subscribes to a WebSocket, reconnects with backoff, "
        "batches updates to avoid re-render storms, and cleans up correctly under StrictMode.",
        "Write a TypeScript type-safe event emitter where each event name maps to its payload type, with `on`, `off` "
        "and `once`, and explain the generics.",
    ))


def _algorithms(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "Write a function to check whether a string is a palindrome.",
        "How does binary search work? Show a simple implementation.",
        "Write a function that returns the largest number in an array without using max().",
        "Implement FizzBuzz.",
    ), (
        "Implement Dijkstra's shortest path algorithm with a priority queue and explain its complexity.",
        "Given an array of integers, return the length of the longest increasing subsequence.",
        f"Write a function that finds all pairs in an array that sum to {d.between(10, 99)} in O(n) time.",
        "Implement a trie that supports insert, search and prefix counting.",
    ), (
        "Give an O(n log n) algorithm for counting inversions in an array, prove it correct, and implement it.",
        f"Solve this: given {d.between(2, 9) * 10**d.between(4, 5)} intervals, find the minimum number of meeting "
        "rooms required, then extend it to return the room assignment. Analyze time and space complexity.",
        "Implement a segment tree with lazy propagation supporting range add and range minimum queries, and explain "
        "every invariant.",
    ))


def _debugging(d: Dice, level: int) -> str:
    err = d.pick(("TypeError: 'NoneType' object is not subscriptable", "IndexError: list index out of range",
                  "KeyError", "a segmentation fault", "an infinite loop", "wrong results for negative numbers",
                  "UnboundLocalError: local variable referenced before assignment", "a race condition in tests"))
    return d.by_level(level, (
        f"My code gives {err}. What does that mean?",
        "Why does this loop print the same value every time?",
        f"Can you fix the bug in this function? It gives {err}.",
    ), (
        f"This function is supposed to compute a running total but it fails with {err}. Find the bug and explain it.",
        f"I get {err} only in production, not locally. Here's the code. What could cause this?",
    ), (
        f"Our service crashes intermittently with {err} under load. Below is the relevant code. Find the root cause, "
        "explain why it only appears under concurrency, and propose a fix with a regression test.",
        f"After upgrading dependencies we see {err} in about 1% of requests. Walk through how you would bisect this "
        "and what in the code below looks suspicious.",
    ))


def _concurrency(d: Dice, level: int) -> str:
    lang = d.pick(("Go", "Python asyncio", "Java", "Rust tokio", "C#"))
    return d.by_level(level, (
        "What is the difference between a thread and a process?",
        f"How do I run two functions at the same time in {lang}?",
        "What does a mutex do?",
    ), (
        f"Write a worker pool in {lang} that processes jobs from a queue with at most {d.between(2, 16)} workers.",
        f"In {lang}, how do I cancel a group of running tasks when one of them fails?",
        f"Write a rate limiter in {lang} that allows {d.between(5, 100)} requests per second per client.",
    ), (
        f"Implement a bounded multi-producer multi-consumer queue in {lang} without deadlocks, with graceful shutdown "
        "and backpressure, and argue why it is free of data races.",
        f"Design a distributed lock on top of Redis for {lang} services; discuss lease expiry, clock skew and fencing "
        "tokens, and write the client code.",
    ))


def _devops(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "How do I undo my last git commit but keep the changes?",
        "Write a bash one-liner that counts the lines in all .py files in a folder.",
        "How do I list the running Docker containers?",
    ), (
        "Write a Dockerfile for a Python web app that uses a multi-stage build and runs as a non-root user.",
        "Write a bash script that backs up a PostgreSQL database every night and deletes backups older than 14 days.",
        "Write a GitHub Actions workflow that runs tests on Python 3.10 and 3.11 and caches pip.",
    ), (
        "Our Kubernetes pods get OOMKilled during deploys even though average memory is low. Explain how requests, "
        "limits and the JVM heap interact, and write a manifest and rollout strategy that avoid it.",
        "Write a zero-downtime deployment script for a service behind nginx that drains connections, runs database "
        "migrations safely and rolls back automatically on failed health checks.",
    ))


def _data(d: Dice, level: int) -> str:
    n = _noun(d)
    return d.by_level(level, (
        "How do I read a CSV file into a pandas DataFrame?",
        "How do I plot a simple line chart with matplotlib?",
        "How do I drop rows with missing values in pandas?",
    ), (
        f"With pandas, group {n} data by month and compute the median and 90th percentile of the amount column.",
        "Write numpy code that normalizes each row of a matrix to unit length without a Python loop.",
        f"Merge two DataFrames of {n}s on id and date where the dates can differ by up to one day.",
    ), (
        f"I have 200 GB of {n} logs in Parquet. Write a pipeline (pandas won't fit in memory) to compute per-user "
        "sessionization with a 30-minute gap rule, and explain how to validate it.",
        "Implement k-means from scratch with numpy, including k-means++ initialisation and a convergence check, "
        "vectorized.",
    ))


def _regex(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "Write a regex that matches a US zip code.",
        "How do I check if a string contains only digits?",
        "Write a regular expression for a simple email address.",
    ), (
        "Write a Python function that parses log lines like `2024-03-01 12:00:03 [WARN] disk 91%` into a dict.",
        "Write a regex that extracts all hashtags from a tweet, excluding ones inside URLs.",
        "Parse a query string into a dictionary without using urllib.",
    ), (
        "Write a recursive-descent parser for arithmetic expressions with +, -, *, /, parentheses and unary minus, "
        "with clear error messages that point at the bad column.",
        "Write a tokenizer and parser for a small subset of JSON by hand, and explain how you handle escape sequences "
        "and deeply nested input.",
    ))


def _systems(d: Dice, level: int) -> str:
    lang = d.pick(("C", "C++", "Rust"))
    return d.by_level(level, (
        f"What is a pointer in {lang}?",
        f"How do I read a line of input in {lang}?",
        "What is the difference between the stack and the heap?",
    ), (
        f"Write a dynamic array in {lang} that grows by doubling and supports push and pop.",
        "Explain ownership and borrowing with an example where the borrow checker rejects the code.",
        f"Write a {lang} function that reads a binary file of fixed-size records and sums one field.",
    ), (
        f"Implement a lock-free single-producer single-consumer ring buffer in {lang} and explain the memory orderings "
        "you chose.",
        f"Write a custom memory allocator in {lang} for fixed-size objects with a free list, and discuss fragmentation "
        "and alignment.",
    ))


TOPICS = {
    "python": _python, "sql": _sql, "javascript": _javascript, "algorithms": _algorithms,
    "debugging": _debugging, "concurrency": _concurrency, "devops": _devops, "data": _data,
    "regex": _regex, "systems": _systems,
}

# --- snippets: a header line and a pool of body lines per topic --------------------------------

_SNIPPETS = {
    "python": ("python", "def process_{n}s(items):", (
        "    result = []", "    for item in items:", "        if item is None:", "            continue",
        "        key = item.get('id')", "        if key in seen:", "            result.append(item)",
        "        seen.add(key)", "    total += item['amount']", "    return result", "    print(len(result))",
        "    data = sorted(data, key=lambda x: x['created'])", "    with open(path) as f:",
        "        rows = [line.strip().split(',') for line in f]", "    except ValueError as e:",
        "        logger.warning('bad {n}: %s', e)")),
    "sql": ("sql", "SELECT c.id, c.name, COUNT(o.id) AS {n}_count", (
        "FROM customers c", "LEFT JOIN {n}s o ON o.customer_id = c.id",
        "WHERE o.created_at >= NOW() - INTERVAL '30 days'",
        "  AND c.status = 'active'", "GROUP BY c.id, c.name", "HAVING COUNT(o.id) > 3", "ORDER BY {n}_count DESC",
        "LIMIT 50;", "  AND o.total > (SELECT AVG(total) FROM {n}s)")),
    "javascript": ("javascript", "function load{N}s(url) {{", (
        "  const res = await fetch(url);", "  if (!res.ok) throw new Error(res.statusText);",
        "  const data = await res.json();", "  setItems(data.items);", "  return data.items.map(x => x.id);",
        "  document.querySelector('#list').innerHTML = '';", "  items.forEach(item => render(item));",
        "  console.log('loaded', data.length);", "}}", "  setLoading(false);")),
    "algorithms": ("python", "def solve(nums, target):", (
        "    lo, hi = 0, len(nums) - 1", "    while lo <= hi:", "        mid = (lo + hi) // 2",
        "        if nums[mid] < target:", "            lo = mid + 1", "        else:", "            hi = mid",
        "    dp = [0] * (len(nums) + 1)", "    for i in range(1, len(nums)):", "    return lo",
        "        best = max(best, dp[i])")),
    "debugging": ("python", "def running_total({n}s):", (
        "    total = 0", "    for i in range(len({n}s) + 1):", "        total += {n}s[i]['amount']",
        "    return totals", "    if not {n}s:", "        return", "    cache[key] = value",
        "    results.append(total)", "    for k, v in mapping.items():", "        del mapping[k]")),
    "concurrency": ("go", "func worker(id int, jobs <-chan Job, results chan<- Result) {{", (
        "    for j := range jobs {{", "        r, err := process(j)", "        if err != nil {{",
        "            log.Println(err)", "            continue", "        }}", "        results <- r", "    }}",
        "    mu.Lock()", "    counter++", "    mu.Unlock()", "    wg.Done()")),
    "devops": ("bash", "#!/usr/bin/env bash", (
        "set -euo pipefail", "BACKUP_DIR=/var/backups/db", "DATE=$(date +%F)",
        "pg_dump \"$DB_URL\" > \"$BACKUP_DIR/db-$DATE.sql\"", "find \"$BACKUP_DIR\" -mtime +14 -delete",
        "docker compose up -d --build", "if ! curl -fsS localhost:8080/health; then", "  exit 1", "fi")),
    "data": ("python", "import pandas as pd", (
        "df = pd.read_csv('{n}s.csv', parse_dates=['date'])", "df = df.dropna(subset=['amount'])",
        "monthly = df.groupby(df['date'].dt.to_period('M'))['amount'].agg(['median', 'mean'])",
        "df['z'] = (df['amount'] - df['amount'].mean()) / df['amount'].std()",
        "merged = df.merge(other, on='id', how='left')", "print(monthly.head())",
        "df.plot(x='date', y='amount')")),
    "regex": ("python", "import re", (
        "PATTERN = re.compile(r'(\\d{{4}}-\\d{{2}}-\\d{{2}}) (\\S+) \\[(\\w+)\\] (.*)')",
        "for line in lines:", "    m = PATTERN.match(line)", "    if not m:", "        continue",
        "    date, time, level, msg = m.groups()", "tags = re.findall(r'#(\\w+)', text)")),
    "systems": ("c", "int *grow(int *arr, size_t *cap) {{", (
        "    size_t new_cap = *cap * 2;", "    int *tmp = realloc(arr, new_cap * sizeof(int));",
        "    if (!tmp) return NULL;", "    *cap = new_cap;", "    return tmp;", "}}",
        "    memcpy(dst, src, n);", "    free(arr);", "    for (size_t i = 0; i <= n; i++) {{")),
}

_REQUIREMENTS = (
    "Add type hints and docstrings.", "Include a few unit tests.", "Explain the time complexity.",
    "Handle empty input gracefully.", "Don't use any third-party libraries.",
    "Keep it readable, this is for a code review.",
    "Add comments explaining the tricky parts.", "It should work on large inputs (millions of rows).",
    "Please explain what each part does, I'm still learning.", "Make it production quality with proper error handling.",
    "Show example input and output.", "Follow PEP 8.", "Make sure it handles unicode correctly.",
    "The solution must not allocate more memory than necessary.", "Log errors instead of crashing.",
)
_CONTEXT = (
    "I'm using Python 3.11 on Ubuntu.", "This is for a small internal tool at work.",
    "I'm preparing for a coding interview.",
    "We deploy on AWS.", "The codebase is about five years old.", "I'm a beginner.", "Our team uses VS Code.",
    "It runs as a cron job every hour.", "Performance matters here because it's on the hot path.",
)


def _snippet(d: Dice, topic: str, target: int) -> str:
    """A fenced code block of about ``target`` tokens: the topic's snippet, cut short or, for long
    pastes, followed by more blocks of the same shape on other nouns (people paste whole files)."""
    lang, header, body = _SNIPPETS[topic]
    blocks: list[str] = []
    used = 0
    for noun in d.sample(_NOUNS, len(_NOUNS)):
        lines = fill([header], iter(body).__next__, target - used, sep="\n", limit=len(body))
        block = "\n".join(lines).replace("{n}", noun).replace("{N}", noun.capitalize())
        blocks.append(block.replace("{{", "{").replace("}}", "}"))
        used += len(block) // 4 + 1
        if used >= target:
            break
    return f"```{lang}\n" + "\n\n".join(blocks) + "\n```"


def write(d: Dice, topic: str, level: int, target: int) -> str:
    task = TOPICS[topic](d, level)
    pieces = [task]
    if d.chance(0.3):
        pieces.insert(0, d.pick(_CONTEXT))
    # Debugging requests nearly always paste code; others do when the prompt has room for it.
    has_code = topic == "debugging" or (target > 70 and d.chance(0.6))
    reqs = deck(d, lambda: _REQUIREMENTS + _CONTEXT)
    if has_code:
        budget = max(target - sum(len(p) for p in pieces) // 4 - 10, 15)
        pieces.append(_snippet(d, topic, budget))
        if d.chance(0.5):
            pieces.append(reqs())
    else:
        n_reqs = (0, 1, 3)[level] if level != MEDIUM or d.chance(0.5) else 2
        pieces.extend(reqs() for _ in range(n_reqs))
        fill(pieces, reqs, target, limit=8)
    if level == EASY and d.chance(0.3):
        pieces.append("Keep it short.")
    elif level == HARD and d.chance(0.5):
        pieces.append("Think about edge cases and explain your design decisions.")
    if has_code:
        return "\n\n".join(pieces)
    return voice(d, " ".join(pieces)) if level == EASY else " ".join(pieces)
