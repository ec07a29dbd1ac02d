// The server's API as the page uses it: the API key (kept in localStorage, sent as a
// Bearer header on /v1 routes), OpenAI error bodies turned into messages, and a reader of
// server-sent events over fetch (EventSource cannot send headers).

const KEY_STORAGE = "pagoda.apiKey";

export function getApiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return "";  // storage refused (private mode): the key lives in the field only
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    /* see getApiKey */
  }
}

export function headers(extra = {}) {
  const key = getApiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// The message of an OpenAI error body ({"error": {"message": ...}}), or the HTTP status.
export async function errorMessage(response) {
  let text = "";
  try {
    text = await response.text();
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    /* not JSON: fall through */
  }
  return `HTTP ${response.status} ${response.statusText}${text ? `: ${text.slice(0, 200)}` : ""}`;
}

export class ApiError extends Error {}

// GET or POST JSON; throws ApiError with the server's message on a non-2xx answer.
export async function fetchJSON(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: headers(options.body ? { "Content-Type": "application/json" } : {}),
  });
  if (!response.ok) throw new ApiError(await errorMessage(response));
  return response.json();
}

// Calls onEvent(parsed JSON) for each `data:` event of an SSE response until it ends,
// "[DONE]" arrives or `signal` aborts (the fetch then rejects with an AbortError).
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    // events are separated by a blank line; a `data:` line carries one JSON value
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") {
          reader.cancel().catch(() => {});
          return;
        }
        onEvent(JSON.parse(data));
      }
    }
  }
}
