// The chat playground: the conversation lives in this page (sent whole with each turn);
// answers stream from POST /v1/chat/completions; Stop aborts the fetch, and the server
// frees the request when the client goes away. The section's data-state says where it
// is: idle, streaming, done, stopped or error.
//
// Sampling fields left empty are left out of the request, so the server's defaults apply
// as they would to any client (as in vLLM); each answer is labelled with the temperature
// it was sampled at.

import { ApiError, errorMessage, headers, readEvents } from "./api.js";

const $ = (id) => document.getElementById(id);

// What the server applies to a request without these fields (OpenAI's defaults; see
// SamplingParams in pagoda/entrypoints/openai/serving_pipeline.py).
export const SERVER_DEFAULTS = { temperature: 1, top_p: 1 };

// "temperature 0.7", or "temperature 1 (server default)" when the request left it out;
// top_p likewise, named only when sent.
export function samplingNote(body) {
  const temperature = body.temperature === undefined
    ? `temperature ${SERVER_DEFAULTS.temperature} (server default)`
    : `temperature ${body.temperature}`;
  return body.top_p === undefined ? temperature : `${temperature} · top_p ${body.top_p}`;
}

function numberField(id, parse) {
  const value = $(id).value.trim();
  return value === "" ? undefined : parse(value);
}

export function setupChat(getModel) {
  const section = $("chat");
  const conversation = $("conversation");
  const message = $("message");
  const send = $("send");
  const stop = $("stop");
  const stats = $("chat-stats");
  const error = $("chat-error");
  const history = [];  // {role, content} of the turns so far
  let controller = null;

  function bubble(role, text, note = "") {
    const item = document.createElement("div");
    item.className = `message ${role}`;
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    if (note) {
      const sampling = document.createElement("span");
      sampling.className = "sampling";
      sampling.textContent = ` · ${note}`;
      label.append(sampling);
    }
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    item.append(label, body);
    conversation.append(item);
    conversation.scrollTop = conversation.scrollHeight;
    return item;
  }

  function showError(text) {
    error.textContent = text;
    error.hidden = !text;
  }

  function setState(state) {
    section.dataset.state = state;
    const busy = state === "streaming";
    send.disabled = busy;
    stop.disabled = !busy;
    if (!busy && document.activeElement === stop) message.focus();
  }

  async function submit() {
    if (controller) return;
    const text = message.value.trim();
    const model = getModel();
    if (!text) return;
    if (!model) {
      showError("No model is loaded on the server.");
      return;
    }
    showError("");
    history.push({ role: "user", content: text });
    bubble("user", text);
    message.value = "";
    const system = $("system").value.trim();
    const body = {
      model,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...history],
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature", parseFloat),
      top_p: numberField("top-p", parseFloat),
      max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
    };  // (JSON.stringify leaves out the undefined fields: the empty ones)
    const answer = bubble("assistant", "", samplingNote(body));
    const answerText = answer.querySelector(".text");
    controller = new AbortController();
    setState("streaming");
    const started = performance.now();
    let content = "", numChunks = 0, firstAt = null, usage = null, outcome = "done";
    const report = (suffix = "") => {
      const numTokens = usage ? usage.completion_tokens : numChunks;
      const elapsed = (performance.now() - (firstAt ?? started)) / 1000;
      const rate = numTokens > 1 && elapsed > 0 ? (numTokens - 1) / elapsed : null;
      const ttft = firstAt === null ? "" : ` · TTFT ${Math.round(firstAt - started)} ms`;
      stats.textContent = `${numTokens} tokens` +
        (rate === null ? "" : ` · ${rate.toFixed(1)} tokens/s`) + ttft + suffix;
    };
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new ApiError(await errorMessage(response));
      await readEvents(response, (event) => {
        if (event.error) throw new ApiError(event.error.message);
        for (const choice of event.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            content += delta;
            numChunks += 1;
            firstAt ??= performance.now();
            answerText.textContent = content;
            conversation.scrollTop = conversation.scrollHeight;
          }
        }
        if (event.usage) usage = event.usage;
        report();
      });
    } catch (e) {
      if (e.name === "AbortError") {
        outcome = "stopped";
        answer.classList.add("stopped");
      } else {
        outcome = "error";
        showError(e.message);
      }
    } finally {
      controller.abort();  // closes the connection whatever happened (no-op when done)
      controller = null;
    }
    if (content) history.push({ role: "assistant", content });
    else {
      history.pop();  // nothing came back: the turn is not part of the conversation
      answer.remove();
    }
    report(outcome === "stopped" ? " · stopped" : "");
    setState(outcome);
  }

  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  stop.addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    conversation.replaceChildren();
    stats.textContent = "";
    showError("");
    message.focus();
  });
}
