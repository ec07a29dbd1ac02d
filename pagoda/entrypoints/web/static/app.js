// The page's wiring: the API key field, the model picker (GET /v1/models, refreshed now
// and then since models come and go), the chat and the engine view of the chosen model.

import { fetchJSON, getApiKey, setApiKey } from "./api.js";
import { setupChat } from "./chat.js";
import { setupEngineView } from "./engine_view.js";

const MODELS_REFRESH_MS = 30000;
const picker = document.getElementById("model");
const apiKey = document.getElementById("api-key");
const status = document.getElementById("status");
const view = setupEngineView();
setupChat(() => picker.value);

async function loadModels() {
  let models;
  try {
    models = (await fetchJSON("/v1/models")).data
      .filter((card) => (card.state ?? "ready") === "ready").map((card) => card.id);
    status.textContent = "";
  } catch (e) {
    status.textContent = `Models: ${e.message}`;
    models = [];
  }
  const previous = picker.value;
  const same = models.length === picker.options.length &&
    models.every((id, i) => picker.options[i].value === id);
  if (same) return;
  picker.replaceChildren(...models.map((id) => new Option(id, id)));
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
