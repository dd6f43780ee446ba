"""The fixed text corpus that token estimates are measured on (bench/token_estimate.py, tests/proxy/routing/test_token_estimate.py).

Owns building bench/data/token_corpus.jsonl from local sources only (Python's own docs and
stdlib code, sentences written here, generated JSON and numbers) and reading it back; it does
not tokenize. The file is committed so that every machine measures the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import sysconfig
import uuid
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "data" / "token_corpus.jsonl"
CATEGORIES = ("english", "code", "cjk", "json", "numbers", "ids", "mixed")
PER_CATEGORY = 30
MIN_BYTES, MAX_BYTES = 100, 4000

# stdlib modules the tiny model's tokenizer was NOT trained on (backends/tinymodel.py CORPUS_MODULES)
CODE_MODULES = ("difflib.py", "inspect.py", "tarfile.py", "asyncio/base_events.py", "dataclasses.py",
                "heapq.py", "fractions.py", "csv.py", "statistics.py", "zipfile.py", "ipaddress.py")

ZH = """人工智能正在改变我们的生活方式，从智能手机到自动驾驶汽车，无处不在。
今天天气很好，我们一起去公园散步吧。
这个模型在处理长文本时表现出色，但在图像理解方面还有改进空间。
请帮我把这份报告翻译成英文，并检查其中的语法错误。
北京是中国的首都，也是一座历史悠久的文化名城。
在分布式系统中，负载均衡器负责把请求分配到不同的服务器上。
缓存命中率越高，首字延迟就越低，用户体验也就越好。
他每天早上六点起床，先跑步半小时，然后吃早饭。
我们需要在下周五之前完成项目的第一阶段，包括需求分析和系统设计。
这本书讲述了一个普通人如何通过努力改变自己命运的故事。
数据库的索引可以大大提高查询速度，但也会占用额外的存储空间。
请问附近有没有好吃的餐馆？我想尝尝当地的特色菜。
机器学习模型的训练需要大量的数据和计算资源。
春天来了，花儿都开了，到处都是一片生机勃勃的景象。
如果你对这个问题有任何疑问，请随时与我们的客服团队联系。
长城是世界上最伟大的建筑工程之一，全长两万多公里。
在编写代码时，良好的命名习惯可以让程序更容易理解和维护。
昨天的会议讨论了明年的预算计划和人员安排。
这张图片里有一只猫坐在窗台上，外面正在下雨。
中国的传统节日包括春节、端午节和中秋节，每个节日都有独特的习俗。
用户反馈说应用程序在高峰时段响应很慢，我们正在排查原因。
学习一门新的语言需要耐心和坚持，每天练习一点点就会有进步。
服务器的内存使用率已经超过了百分之九十，需要尽快扩容。
这道数学题的解法有很多种，你能想出最简单的一种吗？
上海是一座国际化的大都市，金融业和航运业都非常发达。
根据最新的统计数据，今年第三季度的销售额同比增长了百分之十五。
孩子们在操场上踢足球，笑声传得很远。
请描述一下这张图片中的主要内容，并指出其中的文字。
大语言模型可以回答问题、写文章、写代码，还能进行多轮对话。
为了保证系统的稳定性，我们在每次发布之前都会进行完整的回归测试。""".splitlines()

JA = """今日はとても良い天気ですね。散歩に行きましょう。
この写真に写っているものを説明してください。
東京は日本の首都で、世界で最も人口の多い都市の一つです。
機械学習のモデルを訓練するには、大量のデータが必要です。
明日の会議は午後三時から始まりますので、遅れないようにしてください。
このプログラムはキャッシュを使って応答時間を短縮しています。
日本語を勉強して三年になりますが、まだ敬語が難しいです。
駅の近くに新しいラーメン屋ができたので、友達と行ってみました。
サーバーの負荷が高くなったときは、リクエストを別のノードに振り分けます。
桜の季節になると、多くの人が公園でお花見を楽しみます。""".splitlines()

KO = """오늘 날씨가 정말 좋네요. 같이 산책하러 갈까요?
이 사진에 있는 내용을 자세히 설명해 주세요.
서울은 한국의 수도이며 인구가 가장 많은 도시입니다.
서버의 부하가 높아지면 요청을 다른 노드로 분산합니다.
한국어를 배우는 것은 어렵지만 재미있습니다.
다음 주 금요일까지 프로젝트의 첫 단계를 끝내야 합니다.""".splitlines()

WORDS = ("alpha", "request", "worker", "cache", "latency", "token", "model", "image", "prefix", "queue",
         "engine", "router", "status", "user", "session", "price", "order", "customer", "address", "city",
         "temperature", "description", "timestamp", "enabled", "items", "quantity", "weight", "result")


def _target_len(rng: random.Random) -> int:
    return int(math.exp(rng.uniform(math.log(MIN_BYTES), math.log(MAX_BYTES))))


def _fill(rng: random.Random, piece, sep: str = "") -> str:
    """Pieces from `piece()` joined until the UTF-8 length reaches a log-uniform target."""
    target, out, size = _target_len(rng), [], 0
    while size < target:
        p = piece()
        out.append(p)
        size += len(p.encode()) + len(sep)
    return sep.join(out)


def _english_paragraphs() -> list[str]:
    """Prose paragraphs of Python's own documentation (pydoc_data), its indented code left out."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            lines = block.strip("\n").splitlines()
            if not lines or any(line.startswith(" ") for line in lines) or "***" in block or "===" in block:
                continue
            text = " ".join(line.strip() for line in lines)
            letters = sum(c.isalpha() or c == " " for c in text)
            if len(text) > 80 and letters / len(text) > 0.9:
                paras.append(text)
    return paras


def _code_lines() -> list[list[str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / m).read_text().splitlines(keepends=True) for m in CODE_MODULES]


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 3 and kind < 0.3:
        return {rng.choice(WORDS) + ("_" + rng.choice(WORDS) if rng.random() < 0.3 else ""): _json_value(rng, depth + 1)
                for _ in range(rng.randint(1, 5))}
    if depth < 3 and kind < 0.45:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))]
    if kind < 0.6:
        return rng.randint(-10_000, 1_000_000)
    if kind < 0.7:
        return round(rng.uniform(-1000, 1000), rng.randint(1, 6))
    if kind < 0.75:
        return rng.choice([True, False, None])
    if kind < 0.8:
        return rng.choice(ZH)[: rng.randint(2, 12)]
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _numbers(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return ",".join(str(rng.randint(0, 10 ** rng.randint(1, 7))) for _ in range(rng.randint(3, 10))) + "\n"
    if kind == 1:
        return " ".join(f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}" for _ in range(rng.randint(3, 10))) + "\n"
    if kind == 2:
        return (f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z {rng.randint(100, 599)} {rng.random():.4f}\n")
    if kind == 3:
        return f"{rng.randint(1, 9999)} + {rng.randint(1, 9999)} * {rng.randint(1, 99)} = {rng.randint(1, 10**6)}\n"
    return f"{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}:{rng.randint(1, 65535)}\n"


def _identifier(rng: random.Random) -> str:
    """What chat and tool traffic carries besides prose: UUIDs, hashes, base64, URLs, paths."""
    kind = rng.randrange(5)
    if kind == 0:
        return str(uuid.UUID(int=rng.getrandbits(128)))
    if kind == 1:
        return hashlib.sha256(rng.randbytes(8)).hexdigest()[: rng.choice([8, 12, 40, 64])]
    if kind == 2:
        return base64.b64encode(rng.randbytes(rng.randint(12, 90))).decode()
    if kind == 3:
        return (f"https://{rng.choice(WORDS)}.example.com/{rng.choice(WORDS)}/{rng.randint(1, 99999)}"
                f"?{rng.choice(WORDS)}={rng.choice(WORDS)}&id={rng.getrandbits(40):x}")
    return "/" + "/".join(rng.choice(WORDS) + rng.choice(["", "_v2", ".py", ".json", "-01"]) for _ in range(rng.randint(2, 6)))


def build(seed: int = 0) -> list[dict[str, str]]:
    """PER_CATEGORY texts of each category, MIN_BYTES..MAX_BYTES (log-uniform), deterministic for a Python version."""
    rng = random.Random(seed)
    paras, files = _english_paragraphs(), _code_lines()
    out = []

    def add(category: str, text: str) -> None:
        out.append({"category": category, "text": text})

    for _ in range(PER_CATEGORY):
        start = rng.randrange(len(paras))
        it = iter(paras[start:] + paras[:start])
        add("english", _fill(rng, lambda it=it: next(it), "\n\n"))
    for _ in range(PER_CATEGORY):
        lines = rng.choice(files)
        start = rng.randrange(len(lines) - 200)
        it = iter(lines[start:])
        add("code", _fill(rng, lambda it=it: next(it)))
    for _ in range(PER_CATEGORY):
        pool = rng.choice([ZH, ZH, JA, KO])
        add("cjk", _fill(rng, lambda pool=pool: rng.choice(pool), "\n" if rng.random() < 0.5 else ""))
    for _ in range(PER_CATEGORY):
        indent = rng.choice([None, 2])
        ascii_only = rng.random() < 0.5
        add("json", _fill(rng, lambda indent=indent, a=ascii_only: json.dumps(
            _json_value(rng), indent=indent, ensure_ascii=a), "\n"))
    for _ in range(PER_CATEGORY):
        add("numbers", _fill(rng, lambda: _numbers(rng)))
    for _ in range(PER_CATEGORY):
        add("ids", _fill(rng, lambda: _identifier(rng), rng.choice([" ", "\n", ", "])))
    for _ in range(PER_CATEGORY):
        def mixed() -> str:
            r = rng.random()
            if r < 0.4:
                return rng.choice(paras)
            if r < 0.6:
                lines = rng.choice(files)
                s = rng.randrange(len(lines) - 20)
                return "```python\n" + "".join(lines[s:s + rng.randint(3, 15)]) + "```"
            if r < 0.75:
                return "\n".join(f"- {rng.choice(WORDS)}: {rng.randint(0, 9999)}" for _ in range(rng.randint(2, 6)))
            if r < 0.9:
                return rng.choice(ZH) + " " + rng.choice(paras)[:200]
            return json.dumps(_json_value(rng))
        add("mixed", _fill(rng, mixed, "\n\n"))
    return out


def load(path: Path = CORPUS_PATH) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write(path: Path = CORPUS_PATH, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in build(seed):
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote {CORPUS_PATH}")
