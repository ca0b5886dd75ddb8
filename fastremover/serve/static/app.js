// fastremover's page: submit a video + mask to POST /v1/videos, poll the job, show input | output, list jobs.
// No external scripts; the API key (if any) is kept in localStorage and sent as a Bearer header.
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("api-key");
keyInput.value = localStorage.getItem("fastremover-api-key") || "";
keyInput.addEventListener("change", () => localStorage.setItem("fastremover-api-key", keyInput.value));

function headers() {
  const key = keyInput.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body.error) message = body.error.message;
    } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

function setStatus(text, isError = false) {
  const el = $("status");
  el.textContent = text;
  el.className = isError ? "error" : "";
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function poll(id) {
  const bar = $("progress");
  bar.hidden = false;
  for (;;) {
    const response = await api("/v1/videos/" + id);
    const video = await response.json();
    bar.value = video.progress;
    setStatus(video.status + " (" + video.progress + " %)");
    if (video.status === "completed") return video;
    if (video.status === "failed" || video.status === "cancelled") {
      throw new Error(video.status + ": " + (video.error ? video.error.message : "no reason given"));
    }
    await sleep(Number(response.headers.get("openai-poll-after-ms")) || 500);
  }
}

async function showResult(video) {
  const response = await api("/v1/videos/" + video.id + "/content");
  const url = URL.createObjectURL(await response.blob());
  const player = $("result-video");
  player.src = url;
  player.dataset.videoId = video.id;
  const link = $("download");
  link.href = url;
  link.download = video.id + ".mp4";
  $("result").hidden = false;
  setStatus("completed in " + (video.inference_time_s || 0).toFixed(2) + " s");
}

// The box tool: the chosen video's first frame on a canvas; a drag sets the hidden `box` field to X,Y,W,H in the
// video's pixels (the server builds the mask from it when no mask file is given).
const canvas = $("frame");
let drag = null;
let frameImage = null;

function drawFrame(box) {
  const ctx = canvas.getContext("2d");
  if (frameImage) ctx.drawImage(frameImage, 0, 0, canvas.width, canvas.height);
  if (box) {
    ctx.strokeStyle = "#ff2d55";
    ctx.lineWidth = Math.max(1, canvas.width / 240);
    ctx.strokeRect(box.x, box.y, box.w, box.h);
  }
}

function setBox(box) {
  $("box").value = box ? [box.x, box.y, box.w, box.h].join(",") : "";
  $("box-text").textContent = box ? "box " + $("box").value : "";
  drawFrame(box);
}

function videoPoint(event) {
  const rect = canvas.getBoundingClientRect();
  const x = Math.round((event.clientX - rect.left) * canvas.width / rect.width);
  const y = Math.round((event.clientY - rect.top) * canvas.height / rect.height);
  return { x: Math.min(Math.max(x, 0), canvas.width), y: Math.min(Math.max(y, 0), canvas.height) };
}

function boxOf(a, b) {
  return { x: Math.min(a.x, b.x), y: Math.min(a.y, b.y), w: Math.abs(a.x - b.x), h: Math.abs(a.y - b.y) };
}

canvas.addEventListener("mousedown", (event) => { drag = videoPoint(event); });
canvas.addEventListener("mousemove", (event) => { if (drag) drawFrame(boxOf(drag, videoPoint(event))); });
window.addEventListener("mouseup", (event) => {
  if (!drag) return;
  const box = boxOf(drag, videoPoint(event));
  drag = null;
  setBox(box.w > 0 && box.h > 0 ? box : null);
});
$("clear-box").addEventListener("click", () => setBox(null));

$("video").addEventListener("change", () => {
  setBox(null);
  $("box-tool").hidden = true;
  const file = $("video").files[0];
  if (!file) return;
  const probe = document.createElement("video");
  probe.muted = true;
  probe.preload = "auto";
  probe.addEventListener("loadeddata", () => {
    canvas.width = probe.videoWidth;
    canvas.height = probe.videoHeight;
    const still = document.createElement("canvas");
    still.width = probe.videoWidth;
    still.height = probe.videoHeight;
    still.getContext("2d").drawImage(probe, 0, 0);
    frameImage = still;
    drawFrame(null);
    $("box-tool").hidden = false;
  }, { once: true });
  probe.src = URL.createObjectURL(file);
});

$("job-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!$("mask").files.length && !$("box").value) {
    setStatus("choose a mask file, or drag a box around the object on the first frame", true);
    return;
  }
  const form = new FormData(event.target);
  for (const [name, value] of [...form.entries()]) {
    // empty options: the server's defaults; an unchosen file input: not sent
    if (value === "" || (value instanceof File && value.name === "" && value.size === 0)) form.delete(name);
  }
  $("submit").disabled = true;
  $("result").hidden = true;
  $("input-video").src = URL.createObjectURL($("video").files[0]);
  try {
    setStatus("uploading ...");
    const video = await (await api("/v1/videos", { method: "POST", body: form })).json();
    refreshJobs();
    const done = await poll(video.id);
    await showResult(done);
  } catch (error) {
    setStatus(error.message, true);
  } finally {
    $("submit").disabled = false;
    $("progress").hidden = true;
    refreshJobs();
  }
});

async function refreshJobs() {
  try {
    const list = await (await api("/v1/videos?limit=20")).json();
    const body = $("jobs").querySelector("tbody");
    body.replaceChildren();
    for (const video of list.data) {
      const row = document.createElement("tr");
      for (const [value, cls] of [[video.id, "id"], [video.status], [video.progress + " %"], [video.size],
                                  [new Date(video.created_at * 1000).toLocaleString()]]) {
        const cell = document.createElement("td");
        cell.textContent = value;
        if (cls) cell.className = cls;
        row.append(cell);
      }
      const action = document.createElement("td");
      if (video.status === "completed") {
        const button = document.createElement("button");
        button.className = "small";
        button.textContent = "show";
        button.addEventListener("click", () => showResult(video).catch((e) => setStatus(e.message, true)));
        action.append(button);
      }
      row.append(action);
      body.append(row);
    }
  } catch (error) {
    setStatus(error.message, true);
  }
}

$("refresh").addEventListener("click", refreshJobs);
api("/v1/models").then((r) => r.json()).then((m) => { $("model").textContent = "model: " + m.data[0].id; })
  .catch(() => {});
refreshJobs();
