// The page of `h3 serve`: no framework, no build step, nothing from outside the server.
// Everything a user or a job supplies is put in the page as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const videos = new Map();  // job id -> object URL of its downloaded mp4 (fetched once, with the key)

function headers() {
  const key = $("key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function submit(event) {
  event.preventDefault();
  $("message").textContent = "";
  const form = new FormData();
  form.append("prompt", $("prompt").value);
  for (const name of ["size", "seconds", "seed", "steps"]) {
    const value = $(name).value.trim();
    if (value) form.append(name, value);
  }
  if ($("first").files[0]) form.append("input_reference", $("first").files[0]);
  if ($("last").files[0]) form.append("keyframes[last]", $("last").files[0]);
  $("submit").disabled = true;
  try {
    await api("/v1/videos", { method: "POST", body: form });
    await refresh();
  } catch (err) {
    $("message").textContent = err.message;
  } finally {
    $("submit").disabled = false;
  }
}

async function play(job, box) {
  if (box.querySelector("video")) return;
  let url = videos.get(job.id);
  if (!url) {
    const response = await api("/v1/videos/" + encodeURIComponent(job.id) + "/content");
    url = URL.createObjectURL(await response.blob());
    videos.set(job.id, url);
  }
  const video = el("video");
  video.controls = true;
  video.preload = "metadata";
  video.src = url;
  video.dataset.job = job.id;
  const link = el("a", "download", "download mp4");
  link.href = url;
  link.download = job.id + ".mp4";
  box.append(video, link);
}

async function remove(job) {
  try {
    await api("/v1/videos/" + encodeURIComponent(job.id), { method: "DELETE" });
    const url = videos.get(job.id);
    if (url) URL.revokeObjectURL(url);
    videos.delete(job.id);
    await refresh();
  } catch (err) {
    $("message").textContent = err.message;
  }
}

function row(job) {
  const item = el("li", "job");
  item.id = "job-" + job.id;
  const head = el("div", "head");
  head.append(el("span", "prompt", job.prompt), el("span", "status " + job.status, job.status.replace("_", " ")));
  const del = el("button", "small", job.status === "in_progress" || job.status === "queued" ? "cancel" : "delete");
  del.type = "button";
  del.addEventListener("click", () => remove(job));
  head.append(del);
  item.append(head);
  const meta = [job.size, job.seconds + " s", "seed " + job.seed, job.steps + " steps"];
  if (job.replica !== null && job.replica !== undefined) meta.push("replica " + job.replica);
  item.append(el("div", "meta", meta.join(" · ")));
  if (job.status === "queued" || job.status === "in_progress") {
    const bar = el("progress");
    bar.max = 100;
    bar.value = job.progress;
    item.append(bar);
  }
  if (job.error) item.append(el("div", "error", job.error.code + ": " + job.error.message));
  const box = el("div", "player");
  item.append(box);
  if (job.status === "completed") play(job, box).catch((err) => box.append(el("div", "error", err.message)));
  return item;
}

async function refresh() {
  try {
    const list = await (await api("/v1/videos?limit=50")).json();
    const jobs = $("jobs");
    const keep = new Map([...jobs.children].map((item) => [item.id, item]));
    const fresh = [];
    for (const job of list.data) {
      const id = "job-" + job.id;
      const old = keep.get(id);
      // a finished job keeps its element (and its <video>); the others are drawn again
      if (old && old.dataset.status === "completed" && job.status === "completed") { fresh.push(old); continue; }
      const item = row(job);
      item.dataset.status = job.status;
      fresh.push(item);
    }
    jobs.replaceChildren(...fresh);
    const waiting = list.data.filter((j) => j.status === "queued").length;
    const running = list.data.filter((j) => j.status === "in_progress").length;
    $("queue").textContent = running + " running · " + waiting + " queued";
  } catch (err) {
    $("queue").textContent = err.message;  // e.g. the key is missing: said where the list would be
  }
}

async function health() {
  const pill = $("health");
  try {
    const response = await fetch("/health");
    const body = await response.json();
    pill.textContent = body.status === "ok" ? body.model + " · ready" : body.status;
    pill.className = "pill " + (body.status === "ok" ? "ok" : "loading");
  } catch (_) {
    pill.textContent = "unreachable";
    pill.className = "pill down";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("key").value = sessionStorage.getItem("h3-key") || "";
  $("key").addEventListener("change", () => { sessionStorage.setItem("h3-key", $("key").value); refresh(); });
  $("create").addEventListener("submit", submit);
  health();
  refresh();
  setInterval(health, 3000);
  setInterval(refresh, 1000);
});
