"""Sends one chat three times with the official `openai` SDK and one Idempotency-Key.

Usage: openai_idempotent.py BASE_URL KEY TEXT. The key goes in `extra_headers`, as a client
of OpenAI's API sends it. Prints one JSON line per call: {"id", "content", "replayed"} for the
first two (the same text), then {"error_code", "status"} for the third (another text under the
same key), or {"error": ...} when the SDK raises where it should not.
"""

import json
import os
import sys

import openai

base_url, key, text = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=os.environ["FANTOM_API_KEY"], max_retries=0,
                       timeout=60)
headers = {"Idempotency-Key": key}


def say(obj):
    print(json.dumps(obj), flush=True)


def chat(content):
    return client.chat.completions.with_raw_response.create(
        model="code-assistant",
        messages=[{"role": "user", "content": content}],
        extra_headers=headers,
    )


try:
    for _ in range(2):
        raw = chat(text)
        completion = raw.parse()
        say({"id": completion.id, "content": completion.choices[0].message.content,
             "replayed": raw.headers.get("idempotent-replayed") == "true"})
    try:
        chat(text + " and something else")
        say({"error": "another body under the same key was served"})
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        say({"error_code": body.get("code"), "status": e.status_code})
except openai.APIError as e:
    say({"error": str(e)})
