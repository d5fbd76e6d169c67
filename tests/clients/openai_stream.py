"""Streams one chat from the hub with the official `openai` SDK, as a client would.

Usage: openai_stream.py BASE_URL TEXT. Prints one JSON line per content piece as it arrives
(flushed), then {"done": true}; or {"error": ..., "code": ...} when the SDK raises (a stream
cut short ends with an error event, which the SDK turns into an APIError).
"""

import json
import sys

import openai

base_url, text = sys.argv[1], sys.argv[2]
import os

# A project's key (an unknown key is 401, never the project 'default').
client = openai.OpenAI(base_url=base_url, api_key=os.environ["FANTOM_API_KEY"], max_retries=0)


def say(obj):
    print(json.dumps(obj), flush=True)


try:
    stream = client.chat.completions.create(
        model="code-assistant",
        messages=[{"role": "user", "content": text}],
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            say({"piece": chunk.choices[0].delta.content})
    say({"done": True})
except openai.APIError as e:
    body = e.body if isinstance(e.body, dict) else {}
    say({"error": str(e), "code": body.get("code")})
