// The page's wiring: the API key field, the model picker (GET /v1/models, refreshed now
// and then since models come and go; a LoRA adapter is listed as "name (LoRA on base)":
// chatting with it runs its base with the adapter, and the engine view is its base's), the
// chat and the engine view of the chosen model.

import { fetchJSON, getApiKey, setApiKey } from "./api.js";
import { setupChat } from "./chat.js";
import { setupEngineView } from "./engine_view.js";

const MODELS_REFRESH_MS = 30000;
const picker = document.getElementById("model");
const apiKey = document.getElementById("api-key");
const status = document.getElementById("status");
const view = setupEngineView();
setupChat(() => picker.value);

function optionLabel(card) {
  return card.parent ? `${card.id} (LoRA on ${card.parent})` : card.id;
}

async function loadModels() {
  let cards;
  try {
    cards = (await fetchJSON("/v1/models")).data
      .filter((card) => (card.state ?? "ready") === "ready");
    status.textContent = "";
  } catch (e) {
    status.textContent = `Models: ${e.message}`;
    cards = [];
  }
  const models = cards.map((card) => card.id);
  const previous = picker.value;
  const same = models.length === picker.options.length &&
    models.every((id, i) => picker.options[i].value === id);
  if (same) return;
  picker.replaceChildren(...cards.map((card) => new Option(optionLabel(card), card.id)));
  picker.value = models.includes(previous) ? previous : (models[0] ?? "");
  if (picker.value !== previous || !models.length) view.setModel(picker.value || null);
}

apiKey.value = getApiKey();
function useKey() {
  if (apiKey.value.trim() === getApiKey()) return;
  setApiKey(apiKey.value.trim());
  picker.replaceChildren();  // reload and reconnect with the new key
  loadModels();
}
apiKey.addEventListener("change", useKey);
document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();  // Enter in the field applies the key
  useKey();
});
picker.addEventListener("change", () => view.setModel(picker.value || null));
loadModels();
setInterval(loadModels, MODELS_REFRESH_MS);
